"""torch.cuda.CUDAGraph's surface, for the CPU tests of CUDA graphs: the
recording is pointed at it through capture/graphs.py's seam
(`record_graph_class`), and `capturing()` reports a capture in progress to
torch as a GPU would. The replay numbered `at` runs `then` (a death, a
buffer the graph's kernels poison)."""

from unittest import mock


class StandInGraph:
    at, then = None, None

    def __init__(self):
        self.replays = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass

    def replay(self):
        self.replays += 1
        if self.replays == self.at:
            self.then()


def capturing():
    """`torch.cuda.is_current_stream_capturing()` true inside, as between a real graph's capture_begin and end."""
    return mock.patch("torch.cuda.is_current_stream_capturing", return_value=True)
