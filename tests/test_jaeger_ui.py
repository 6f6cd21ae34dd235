"""Jaeger's own web UI, as a user opens it after a crash: the built UI of
../shared/jaeger-ui served by the Jaeger .ci/backends builds, in Debian's
headless Chromium driven by Playwright. The example service exports straight
to Jaeger (no Collector, so no sampling): a NaN request, then a crash inside
a kernel (SIGABRT) whose call in flight the sidecar exports, alone and in a
batch of five requests, each of whose traces shows it. The assertions
are on what the pages show. The screenshots go to a scratch folder, or with
SCREENSHOTS=docs to docs/, where the README and docs/backends.md show them."""

import os
import random
import re
import signal

import pytest

from backends import ROOT, Jaeger, ensure_built, operation, wait
from test_backends import BAD, FAILING, NAN, _crash, _post, _service, _together

UI = os.path.join(os.path.dirname(ROOT), "shared", "jaeger-ui")
CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(UI, "index.html")),
    reason=f"Jaeger's built UI is not at {UI} (it ships beside this project's CI, not with a clone; "
           "Jaeger's container image serves it to users)")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    ensure_built()
    tmp_path = tmp_path_factory.mktemp("jaeger-ui")
    jaeger = Jaeger(tmp_path, ui=UI)
    try:
        endpoint = f"http://{jaeger.otlp}"
        rng = random.Random(27)  # trace ids that look like real ones in the screenshots
        ids = {what: rng.getrandbits(128) for what in ("healthy", "nan", "crash")}
        server, port = _service(tmp_path, "example", endpoint)
        try:
            assert _post(port, [4, 5], ids["healthy"]) == 200
            assert _post(port, NAN, ids["nan"]) == 200
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        _crash(tmp_path, "example-crash", endpoint, ids["crash"])
        # Five requests batched together, one of which kills the server inside the embedding kernel.
        ids["batched"] = [rng.getrandbits(128) for _ in range(5)]
        server, port = _service(tmp_path, "example-batched-crash", endpoint, "--crash", "--batch-window-ms", "1000")
        answers = _together(port, [(BAD if i == FAILING else [1 + i, 2], t) for i, t in enumerate(ids["batched"])])
        assert [status for status, _ in answers] == [None] * 5  # the server died answering
        server.wait(timeout=60)
        assert server.returncode == -signal.SIGABRT, server.stderr.read()
        for trace_id in (ids["crash"], *ids["batched"]):
            wait("the crash trace in Jaeger, in flight call included",
                 lambda: any(span["operationName"] == "sglang.custom_op.embedding"
                             for span in jaeger.trace(trace_id)["spans"]), timeout=60)
        wait("the NaN trace in Jaeger", lambda: len(jaeger.trace(ids["nan"])["spans"]) >= 5, timeout=60)
        yield jaeger, ids
    finally:
        jaeger.close()


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    assert os.access(CHROMIUM, os.X_OK), "Debian's chromium is needed (bash .ci/install --tests installs it)"
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> str:
    """Where the screenshots go: a run of the tests leaves the tracked ones alone."""
    return os.environ.get("SCREENSHOTS") or str(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 820})
    page.set_default_timeout(20_000)
    yield page
    page.close()


def _open_trace(page, jaeger, trace_id: int):
    page.goto(f"{jaeger.query}/trace/{trace_id:032x}")
    page.wait_for_selector(".span-row")


def _row(page, operation: str):
    return page.locator(".span-row", has=page.locator(".endpoint-name", has_text=re.compile(f"^{re.escape(operation)}$")))


def _tags(page) -> dict:
    """The tags of the span whose detail is open, as the table shows them."""
    page.locator(".AccordianKeyValues--header", has_text="Tags").click()
    rows = page.locator(".KeyValueTable--row")
    rows.first.wait_for()
    return {row.locator("td").nth(0).inner_text().strip(): re.sub(r"\s*\n\s*", "", row.locator("td").nth(1).inner_text().strip())
            for row in rows.all()}


def _micros(label: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(μs|ms|s)", label.strip()).groups()
    return float(number) * {"μs": 1, "ms": 1e3, "s": 1e6}[unit]


def test_a_request_of_a_batch_killed_by_another_request_shows_the_call_in_flight_as_an_error(world, page, shots):
    """The README's screenshot: a healthy request, batched with the one whose
    token killed the server, opened by the trace id its client sent."""
    jaeger, ids = world
    _open_trace(page, jaeger, ids["batched"][0])
    assert page.locator(".TracePageHeader--title").inner_text().startswith("example-batched-crash: POST /generate")
    names = [operation(name.strip()) for name in page.locator(".span-row .endpoint-name").all_inner_texts()]
    # Nested in this order: the request, its part in the batch, the batch's kernel that was running at the death.
    assert names == ["POST /generate req-N", "decode_batch.request", "sglang.custom_op.embedding"]
    kernel = _row(page, "sglang.custom_op.embedding")
    assert kernel.locator(".SpanBarRow--errorIcon").count() == 1
    assert _micros(kernel.locator(".SpanBar--label").inner_text()) >= 40_000  # until the process died
    kernel.locator(".span-name").click()
    tags = _tags(page)
    assert tags["sglang.kernel.in_flight"] == "true" and tags["error"] == "true"
    assert tags["sglang.kernel.input.arg0.shape"] == "[5,2]" and tags["sglang.kernel.input.arg0.dtype"] == "torch.int64"
    assert tags["sglang.kernel.input.arg0.max"] == "99"  # the other request's token, outside the vocabulary
    assert re.fullmatch(r"[0-9a-f]{32}:[0-9a-f]{16}", tags["sglang.kernel.copy_of"])  # the call in the batch's trace
    page.screenshot(path=os.path.join(shots, "jaeger-crash-trace.png"))


def test_the_crash_trace_of_a_batch_of_one_shows_the_request_its_batch_and_the_call_in_flight(world, page):
    jaeger, ids = world
    _open_trace(page, jaeger, ids["crash"])
    assert page.locator(".TracePageHeader--title").inner_text().startswith("example-crash: POST /generate")
    names = [operation(name.strip()) for name in page.locator(".span-row .endpoint-name").all_inner_texts()]
    assert names == ["POST /generate req-N", "decode_batch", "sglang.custom_op.embedding"]  # nested in this order
    kernel = _row(page, "sglang.custom_op.embedding")
    assert kernel.locator(".SpanBarRow--errorIcon").count() == 1
    # Its bar runs until the process died (50 ms into the call), not a 0 us sliver.
    assert _micros(kernel.locator(".SpanBar--label").inner_text()) >= 40_000
    kernel.locator(".span-name").click()
    tags = _tags(page)
    assert tags["sglang.kernel.in_flight"] == "true" and tags["error"] == "true"
    assert tags["otel.status_description"] == "the process ended during this call (no end record)"
    assert tags["sglang.kernel.input.arg0.shape"] == "[1,2]" and tags["sglang.kernel.input.arg0.dtype"] == "torch.int64"
    assert tags["sglang.kernel.input.arg0.max"] == "99"  # the token outside the 32-token vocabulary
    assert tags["thread.name"] == "scheduler"
    # Jaeger warns of nothing it had to mend (a span ending before it starts, say).
    assert page.locator(".AccordianWarnings").count() == 0 or \
        "Negative duration" not in page.locator(".AccordianWarnings").inner_text()


def test_a_kernel_span_shows_its_tensor_tags_and_nan_flags(world, page, shots):
    jaeger, ids = world
    _open_trace(page, jaeger, ids["nan"])
    _row(page, "sglang.custom_op.rmsnorm").locator(".span-name").click()
    tags = _tags(page)
    assert tags["sglang.kernel.has_nan"] == "true" and tags["sglang.kernel.output.has_nan"] == "true"
    assert tags["sglang.kernel.output.nan_count"] == "8"
    assert tags["sglang.kernel.input.arg0.has_nan"] == "false"  # finite inputs: this kernel made the NaN
    assert tags["sglang.kernel.input.arg0.shape"] == "[1,2,8]" and tags["sglang.kernel.input.arg0.stride"] == "[16,8,1]"
    assert tags["sglang.kernel.input.arg0.contiguous"] == "true" and tags["sglang.kernel.input.arg0.device"] == "cpu"
    page.set_viewport_size({"width": 1400, "height": 1600})  # the output's tags too
    page.screenshot(path=os.path.join(shots, "jaeger-nan-tags.png"))


def test_the_tag_search_has_nan_finds_the_nan_trace_alone(world, page, shots):
    jaeger, ids = world
    page.goto(f"{jaeger.query}/search")
    page.locator(".ant-form-item", has_text="Service").locator(".ant-select").first.click()
    page.locator('.ant-select-item-option[title="example"]').click()
    page.fill("input[name=tags]", "sglang.kernel.has_nan=true")
    page.click(".SearchForm--submit")
    page.wait_for_selector(".ResultItem")
    found = {link.get_attribute("href").rsplit("/", 1)[1] for link in page.locator(".ResultItem a[href*='/trace/']").all()}
    assert found == {f"{ids['nan']:032x}"}
    assert "\n1 Trace\n" in page.locator(".SearchResults--header").inner_text()
    assert page.locator(".ResultItem").count() == 1
    page.screenshot(path=os.path.join(shots, "jaeger-search-has-nan.png"))


def test_the_search_list_tells_the_requests_of_a_batch_apart_by_their_ids(world, page, shots):
    """Five requests of one batch, one crash: each trace in the list is named
    by its request's id, so the one a customer names is found without opening five."""
    jaeger, ids = world
    page.goto(f"{jaeger.query}/search")
    page.locator(".ant-form-item", has_text="Service").locator(".ant-select").first.click()
    page.locator('.ant-select-item-option[title="example-batched-crash"]').click()
    page.click(".SearchForm--submit")
    page.wait_for_selector(".ResultItem")
    titles = sorted(re.sub(r"\s+", " ", title.inner_text()).strip()
                    for title in page.locator(".ResultItem .ResultItemTitle--title .TraceName").all())
    # The batch's own trace, and the five requests' traces, each by its id.
    assert [re.sub(r"req-\d{4}", "req-N", title) for title in titles] == \
        ["example-batched-crash: POST /generate req-N"] * 5 + ["example-batched-crash: decode_batch"], titles
    assert len(set(titles)) == 6, titles
    page.screenshot(path=os.path.join(shots, "jaeger-search-request-ids.png"))
