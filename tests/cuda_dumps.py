"""Synthetic CUDA core dumps, written to the layout of NVIDIA's public
`cudacoredump.h` (see docs/cuda-coredump-format.md), for the CPU tests of the
reader: an ELF core (OSABI ELFOSABI_CUDA, machine EM_CUDA) whose tables link
to their parent table by sh_link and to the parent's row by sh_info, and a
relocated cubin whose symbol table names the kernel.

Two generations of entry sizes: "r346" (the baseline rows) and "r575" (every
field the newest drivers add, the added bytes filled with 0xA5 where a reader
must not look, or set where it may)."""

from __future__ import annotations

import struct

LOUSER = 0x80000000
RELF_IMG, DEV_TABLE, CTX_TABLE, SM_TABLE, GRID_TABLE, CTA_TABLE, WP_TABLE, LN_TABLE, MOD_TABLE, META = (
    LOUSER + n for n in (7, 9, 10, 11, 12, 13, 14, 15, 16, 22))
STRTAB, SYMTAB = 3, 2
WARP_ILLEGAL_ADDRESS, WARP_ASSERT = 14, 12
KERNEL_ENTRY = 0x7F00_0000_1000
KERNEL = "_ZN10flashinfer4norm13RMSNormKernelIfEEvPT_S3_S3_jf"  # void flashinfer::norm::RMSNormKernel<float>(...)
OTHER = "_Z13other_kernelPf"

# Baseline and newest row sizes of each table (cudacoredump.h: r346, r575).
SIZES = {"r346": {"dev": 72, "ctx": 40, "mod": 8, "grid": 104, "sm": 8, "cta": 24, "warp": 32, "lane": 48},
         "r575": {"dev": 88, "ctx": 40, "mod": 8, "grid": 136, "sm": 40, "cta": 56, "warp": 64, "lane": 56}}


def _row(fmt: str, values: tuple, size: int, fill: int = 0xA5) -> bytes:
    packed = struct.pack("<" + fmt, *values)
    return packed + bytes([fill]) * (size - len(packed))


def cubin(functions: list[tuple[str, int, int]]) -> bytes:
    """A minimal ELF64 with .symtab and .strtab: (name, address, size) per function."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name, _, _ in functions)
    symbols = bytes(24)  # the null symbol
    offset = 1
    for name, address, size in functions:
        symbols += struct.pack("<IBBHQQ", offset, 0x12, 0, 1, address, size)  # GLOBAL FUNC
        offset += len(name) + 1
    shstr = b"\0.symtab\0.strtab\0.shstrtab\0"
    body_at = 64
    sym_at, str_at = body_at, body_at + len(symbols)
    shstr_at = str_at + len(names)
    sh_at = (shstr_at + len(shstr) + 7) // 8 * 8
    sections = [bytes(64),
                struct.pack("<IIQQQQIIQQ", 1, SYMTAB, 0, 0, sym_at, len(symbols), 2, 1, 8, 24),
                struct.pack("<IIQQQQIIQQ", 9, STRTAB, 0, 0, str_at, len(names), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", 17, STRTAB, 0, 0, shstr_at, len(shstr), 0, 0, 1, 0)]
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01\x33" + bytes(8), 2, 0xBE, 1, 0, 0, sh_at, 0,
                         64, 0, 0, 64, len(sections), 3)
    blob = header + symbols + names + shstr
    return blob + bytes(sh_at - len(blob)) + b"".join(sections)


class DumpBuilder:
    """Sections appended in order; `build()` lays them out after the ELF header."""

    def __init__(self) -> None:
        self.sections: list[tuple] = [("", 0, b"", 0, 0, 0)]  # the null section
        self.strings = bytearray(b"\0")

    def string(self, text: str) -> int:
        at = len(self.strings)
        self.strings += text.encode() + b"\0"
        return at

    def add(self, name: str, kind: int, data: bytes, link: int = 0, info: int = 0, entsize: int = 0) -> int:
        self.sections.append((name, kind, data, link, info, entsize))
        return len(self.sections) - 1

    def build(self) -> bytes:
        self.add(".strtab", STRTAB, bytes(self.strings))
        shstrndx = len(self.sections)
        names, offsets = bytearray(b"\0"), []
        for name in [section[0] for section in self.sections] + [".shstrtab"]:
            offsets.append(len(names) if name else 0)
            if name:
                names += name.encode() + b"\0"
        self.sections.append((".shstrtab", STRTAB, bytes(names), 0, 0, 0))
        body = bytearray()
        placed = []
        for _, _, data, *_ in self.sections:
            placed.append(64 + len(body))
            body += data + bytes(-len(data) % 8)
        sh_at = 64 + len(body)
        headers = b"".join(
            struct.pack("<IIQQQQIIQQ", offsets[i], kind, 0, 0, placed[i] if data else 0, len(data), link, info, 8,
                        entsize)
            for i, (name, kind, data, link, info, entsize) in enumerate(self.sections))
        header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01\x33" + bytes(8), 4, 0xBE, 1, 0, 0, sh_at, 0,
                             64, 0, 0, 64, len(self.sections), shstrndx)
        return header + bytes(body) + headers


def fault_dump(generation: str = "r575", exception: int = WARP_ILLEGAL_ADDRESS, lane: int = 5,
               kernel: str = KERNEL, timestamp: int = 0) -> bytes:
    """One device (an H200) running two grids: the faulting one, `kernel`, on
    SM 3 (block (2,0,0), warp 12, lane `lane` with `exception`), and another
    kernel's grid whose lanes are healthy."""
    sizes = SIZES[generation]
    new = generation != "r346"
    dump = DumpBuilder()
    device = _row("QQQ12I", (dump.string("NVIDIA H200"), dump.string("GH100"), dump.string("sm_90"), 0, 0x19, 0,
                             132, 64, 32, 255, 7, 9, 0, 16, 0), sizes["dev"])
    devices = dump.add(".cudbg.devtbl", DEV_TABLE, device, entsize=sizes["dev"])
    if new:
        dump.add(".cudbg.meta", META, _row("Q6I", (0, 580, 65, 12, 9, 47, timestamp), 32), entsize=32)
    contexts = dump.add(".cudbg.ctxtbl.dev0", CTX_TABLE, _row("4Q2I", (0xC0, 0, 0, 0, 0, 4242), sizes["ctx"]),
                        link=devices, info=0, entsize=sizes["ctx"])
    modules = dump.add(".cudbg.modtbl.dev0.ctx0", MOD_TABLE, _row("Q", (0xA1,), 8) + _row("Q", (0xA2,), 8),
                       link=contexts, info=0, entsize=8)
    dump.add(".cudbg.relfimg.dev0.ctx0", RELF_IMG, cubin([(OTHER, 0x7F00_0000_9000, 0x100)]), link=modules, info=1)
    dump.add(".cudbg.relfimg.dev0.ctx0", RELF_IMG, cubin([("_Z6helperv", KERNEL_ENTRY - 0x400, 0x400),
                                                          (kernel, KERNEL_ENTRY, 0x800)]), link=modules, info=0)
    grid_fields = "7Q12I" + ("8I" if new else "")
    extra = (1, 1, 1, 0, 0, 0, 0, 0) if new else ()
    grids = _row(grid_fields, (7, 0xC0, 0xF1, KERNEL_ENTRY, 0xA1, 0, 0x160, 1, 1, 2, 40, 6, 8, 1, 128, 1, 1, 0, 4242)
                 + extra, sizes["grid"])
    grids += _row(grid_fields, (9, 0xC0, 0xF2, 0x7F00_0000_9000, 0xA2, 0, 0x160, 1, 1, 2, 16, 1, 1, 1, 32, 1, 1, 0,
                                4242) + extra, sizes["grid"])
    dump.add(".cudbg.gridtbl.dev0", GRID_TABLE, grids, link=devices, info=0, entsize=sizes["grid"])
    sm_rows = b""
    for sm in (0, 3):  # the newest drivers' SM rows say which exception, and its PC
        faulty = sm == 3
        sm_rows += (_row("4IQ", (sm, 0, exception if faulty else 0, int(faulty), KERNEL_ENTRY + 0x230 if faulty else 0),
                         sizes["sm"]) if new else _row("2I", (sm, 0), sizes["sm"]))
    sms = dump.add(".cudbg.smtbl.dev0", SM_TABLE, sm_rows, link=devices, info=0, entsize=sizes["sm"])
    for sm_index, (grid_id, block, faulty) in enumerate(((9, (0, 0, 0), False), (7, (2, 0, 0), True))):
        ctas = dump.add(f".cudbg.ctatbl.dev0.sm{sm_index}", CTA_TABLE, _row("Q4I", (grid_id, *block, 0), sizes["cta"]),
                        link=sms, info=sm_index, entsize=sizes["cta"])
        warp = _row("Q6I", (KERNEL_ENTRY + 0x230 if faulty else 0, 12, 0xFFFFFFFF, 0xFFFFFFFF, 0, int(faulty), 0),
                    sizes["warp"])
        warps = dump.add(f".cudbg.wptbl.dev0.sm{sm_index}.cta0", WP_TABLE, warp, link=ctas, info=0,
                         entsize=sizes["warp"])
        lanes = b"".join(_row("QQ8I", (KERNEL_ENTRY + 0x230, 0x230, n, 32 + n, 0, 0,
                                       exception if faulty and n == lane else 0, 1, 0, 0), sizes["lane"])
                         for n in range(8))
        dump.add(f".cudbg.lntbl.dev0.sm{sm_index}.cta0.wp0", LN_TABLE, lanes, link=warps, info=0,
                 entsize=sizes["lane"])
    return dump.build()
