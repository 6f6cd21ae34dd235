"""Reading a CUDA core dump: which kernel faulted, where, and how.

The CUDA driver writes one on a device exception when asked
(record/coredumps.py). It is an ELF core file (OSABI ELFOSABI_CUDA, machine
EM_CUDA) whose sections are tables: devices, contexts, modules, grids, SMs,
blocks (CTAs), warps and lanes, linked to their parent table by `sh_link`
and to their parent's row by `sh_info`, plus each module's relocated cubin,
whose symbol table names the kernel. The layout is NVIDIA's public
`cudacoredump.h` (cuda-gdb's open-source tree, format history up to driver
r575; docs/cuda-coredump-format.md). Tables grow fields across driver
versions: each is read by its section's entry size, and fields past it read
as absent.

A dump is hostile input like a trace file: every offset and count is checked
against the file, what is read is bounded, nothing in it is run, and a file
that is not a CUDA core dump is refused with one line (`CoreDumpError`).
Demangling runs the system's `c++filt` on the names, where there is one.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import shutil
import struct
import subprocess
from typing import Any

from .. import files

ELFOSABI_CUDA, EM_CUDA, ET_CORE = 0x33, 0xBE, 4
_SHT_LOUSER = 0x80000000
SHT_RELF_IMG, SHT_DEV_TABLE, SHT_CTX_TABLE, SHT_SM_TABLE, SHT_GRID_TABLE, SHT_CTA_TABLE, SHT_WP_TABLE, \
    SHT_LN_TABLE, SHT_MOD_TABLE, SHT_META_DATA = (_SHT_LOUSER + n for n in (7, 9, 10, 11, 12, 13, 14, 15, 16, 22))
SHT_SYMTAB, SHT_STRTAB, STT_FUNC = 2, 3, 2

# CUDBGException_t (cudadebugger.h); codes 11, 13, 15 and 16 were retired in CUDA 13.1.
EXCEPTIONS = {
    1: "LANE_ILLEGAL_ADDRESS", 2: "LANE_USER_STACK_OVERFLOW", 3: "DEVICE_HARDWARE_STACK_OVERFLOW",
    4: "WARP_ILLEGAL_INSTRUCTION", 5: "WARP_OUT_OF_RANGE_ADDRESS", 6: "WARP_MISALIGNED_ADDRESS",
    7: "WARP_INVALID_ADDRESS_SPACE", 8: "WARP_INVALID_PC", 9: "WARP_HARDWARE_STACK_OVERFLOW",
    10: "DEVICE_ILLEGAL_ADDRESS", 11: "LANE_MISALIGNED_ADDRESS", 12: "WARP_ASSERT", 13: "LANE_SYSCALL_ERROR",
    14: "WARP_ILLEGAL_ADDRESS", 15: "LANE_NONMIGRATABLE_ATOMSYS", 16: "LANE_INVALID_ATOMSYS",
    17: "CLUSTER_OUT_OF_RANGE_ADDRESS", 18: "CLUSTER_BLOCK_NOT_PRESENT", 19: "WARP_STACK_CANARY",
    20: "WARP_TMEM_ACCESS_CHECK", 21: "WARP_TMEM_LEAK", 22: "WARP_CALL_REQUIRES_NEWER_DRIVER",
}
_UNKNOWN_EXCEPTION = 0xFFFFFFFF

# Each table's fields as (name, struct code), in the baseline layout (driver
# r346) and then the fields later drivers added; a row is read up to its
# section's entry size, which must hold the baseline.
_DEVICE = (("devName", "Q"), ("devType", "Q"), ("smType", "Q"), ("devId", "I"), ("pciBusId", "I"),
           ("pciDevId", "I"), ("numSMs", "I"), ("numWarpsPerSM", "I"), ("numLanesPerWarp", "I"),
           ("numRegsPerLane", "I"), ("numPredicatesPrLane", "I"), ("smMajor", "I"), ("smMinor", "I"),
           ("instructionSize", "I"), ("status", "I"))
_GRID = (("gridId64", "Q"), ("contextId", "Q"), ("function", "Q"), ("functionEntry", "Q"), ("moduleHandle", "Q"),
         ("parentGridId64", "Q"), ("paramsOffset", "Q"), ("kernelType", "I"), ("origin", "I"), ("gridStatus", "I"),
         ("numRegs", "I"), ("gridDimX", "I"), ("gridDimY", "I"), ("gridDimZ", "I"), ("blockDimX", "I"),
         ("blockDimY", "I"), ("blockDimZ", "I"), ("attrLaunchBlocking", "I"), ("attrHostTid", "I"))
_SM = (("smId", "I"), ("padding0", "I"), ("exception", "I"), ("errorPCValid", "I"), ("errorPC", "Q"))  # r555: 3..5
_SM_BASE = 2
_CTA = (("gridId64", "Q"), ("blockIdxX", "I"), ("blockIdxY", "I"), ("blockIdxZ", "I"), ("padding0", "I"))
_WARP = (("errorPC", "Q"), ("warpId", "I"), ("validLanesMask", "I"), ("activeLanesMask", "I"),
         ("isWarpBroken", "I"), ("errorPCValid", "I"), ("padding0", "I"))
_LANE = (("virtualPC", "Q"), ("physPC", "Q"), ("ln", "I"), ("threadIdxX", "I"), ("threadIdxY", "I"),
         ("threadIdxZ", "I"), ("exception", "I"), ("callDepth", "I"), ("syscallCallDepth", "I"), ("ccRegister", "I"))
_MODULE = (("moduleHandle", "Q"),)
_META = (("generatorName", "Q"), ("driverVersionMajor", "I"), ("driverVersionMinor", "I"),
         ("cudaDriverVersionMajor", "I"), ("cudaDriverVersionMinor", "I"), ("flags", "I"), ("timestamp", "I"))

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
MAX_SECTIONS = 1 << 22  # a dump of every lane of a large GPU has millions of sections: past this, refused
MAX_ROWS = 1 << 20  # rows read from one table
MAX_SYMBOLS = 1 << 18  # symbols read from one cubin
MAX_FAULTS = 64  # faulting lanes kept (a warp's 32 lanes share one fault)
MAX_NAME = 4096  # bytes of a symbol's or a string's name
# How the driver names a dump here and in SGLang: cuda_coredump_<host>.<pid>.<time>.
_DUMP_NAME = re.compile(r"cuda_coredump_(?P<host>.+)\.(?P<pid>\d+)\.(?P<time>[^.]+)")


class CoreDumpError(Exception):
    """A file that is not a CUDA core dump this reader can read (one line)."""


@dataclasses.dataclass
class DeviceFault:
    """One faulting lane (or, where its warp has exited, SM) of a dump."""

    exception: str  # CUDBGException_t's name less CUDBG_EXCEPTION_, e.g. WARP_ILLEGAL_ADDRESS
    code: int
    kernel: str | None  # demangled where c++filt is here
    mangled: str | None
    device: int
    device_name: str | None
    sm: int | None
    warp: int | None
    lane: int | None
    grid: tuple | None  # grid dimensions
    block: tuple | None  # block dimensions
    block_index: tuple | None
    thread_index: tuple | None
    error_pc: int | None
    pc: int | None
    grid_id: int | None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("error_pc", "pc"):
            out[key] = f"0x{out[key]:x}" if out[key] is not None else None
        return out


@dataclasses.dataclass
class CoreDump:
    path: str
    host: str | None  # from the file's name
    pid: int | None
    time: int | None  # seconds since the epoch: the metadata's (driver r565 on), else the name's, else the file's
    driver: str | None  # e.g. "580.65 (CUDA 12.9)", from the metadata
    faults: list[DeviceFault]
    notes: list[str]  # what could not be read (a table past the end of the file, ...)

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.path, "host": self.host, "pid": self.pid, "time": self.time, "driver": self.driver,
                "faults": [fault.as_dict() for fault in self.faults], "notes": self.notes}


def is_cuda_coredump(path: str) -> bool:
    """Whether `path` is a regular file that begins as a CUDA core dump does."""
    try:
        fd = files.open_regular(path)
    except (OSError, files.NotRegularFile):  # a FIFO is not opened to be read: the trace reader says what it is
        return False
    try:
        head = os.pread(fd, _ELF_HEADER.size, 0)
    finally:
        os.close(fd)
    return (len(head) == _ELF_HEADER.size and head[:4] == b"\x7fELF" and head[7] == ELFOSABI_CUDA
            and struct.unpack_from("<HH", head, 16) == (ET_CORE, EM_CUDA))


@dataclasses.dataclass
class _Section:
    index: int
    name: str
    type: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


class _Dump:
    """The mapped file and its sections, every read checked."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = files.open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size < _ELF_HEADER.size:
                raise CoreDumpError(f"{path}: not a CUDA core dump ({size} bytes, shorter than an ELF header)")
            self.data = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.notes: list[str] = []
        ident, kind, machine, *_, shstrndx = _ELF_HEADER.unpack_from(self.data)
        if ident[:4] != b"\x7fELF":
            raise CoreDumpError(f"{path}: not a CUDA core dump (no ELF magic)")
        if ident[4] != 2 or ident[5] != 1:
            raise CoreDumpError(f"{path}: not a CUDA core dump this reader takes (not 64-bit little-endian ELF)")
        if ident[7] != ELFOSABI_CUDA or machine != EM_CUDA or kind != ET_CORE:
            raise CoreDumpError(f"{path}: an ELF file but not a CUDA core dump (OSABI {ident[7]:#x}, machine "
                                f"{machine:#x}, type {kind}; a dump has {ELFOSABI_CUDA:#x}, {EM_CUDA:#x}, {ET_CORE})")
        raw = _section_headers(self.data, 0, len(self.data))
        if isinstance(raw, str):
            raise CoreDumpError(f"{path}: {raw}")
        if not raw or shstrndx >= len(raw):
            raise CoreDumpError(f"{path}: damaged CUDA core dump (no section table, or names in section {shstrndx})")
        names = raw[shstrndx]
        if names[1] != SHT_STRTAB or names[4] + names[5] > len(self.data):
            raise CoreDumpError(f"{path}: damaged CUDA core dump (no section names)")
        self.sections = [_Section(i, self._string(names[4], names[5], entry[0]), entry[1], entry[4], entry[5],
                                  entry[6], entry[7], entry[9]) for i, entry in enumerate(raw)]
        self.strings = next((s for s in self.sections if s.type == SHT_STRTAB and s.name == ".strtab"), None)
        self._rows: dict = {}  # (section, fields) -> its rows: a warp table is read for each of its lanes' tables

    def _string(self, offset: int, size: int, index: int) -> str:
        if index >= size:
            return ""
        start = offset + index
        end = self.data.find(b"\0", start, min(offset + size, start + MAX_NAME))
        return self.data[start: end if end >= 0 else min(offset + size, start + MAX_NAME)].decode("utf-8", "replace")

    def string(self, index: int) -> str | None:
        """A name the tables give as an index into .strtab."""
        if self.strings is None or not index:
            return None
        return self._string(self.strings.offset, self.strings.size, index) or None

    def of_type(self, kind: int) -> list[_Section]:
        return [section for section in self.sections if section.type == kind]

    def rows(self, section: _Section, fields: tuple, base: int | None = None) -> list[dict]:
        """The rows of a table, each field past the entry size left out; none
        (and a note) when the entry size cannot hold the baseline fields or
        the table runs past the end of the file."""
        key = (section.index, fields)
        if key not in self._rows:
            self._rows[key] = self._read_rows(section, fields, base)
        return self._rows[key]

    def _read_rows(self, section: _Section, fields: tuple, base: int | None) -> list[dict]:
        base_fields = fields[: base if base is not None else len(fields)]
        needed = struct.calcsize("<" + "".join(code for _, code in base_fields))
        if section.entsize < needed or section.size % section.entsize:
            self.notes.append(f"table {section.name} has entries of {section.entsize} bytes, not a whole number "
                              f"of rows of at least {needed}: skipped")
            return []
        if section.offset + section.size > len(self.data):
            self.notes.append(f"table {section.name} runs past the end of the file (truncated): skipped")
            return []
        # Fields the entry holds: the baseline and those added since that fit.
        held, size = [], 0
        for name, code in fields:
            width = struct.calcsize("<" + code)
            size = (size + width - 1) // width * width
            if size + width > section.entsize:
                break
            held.append((name, code, size))
            size += width
        rows = []
        for index in range(min(section.size // section.entsize, MAX_ROWS)):
            start = section.offset + index * section.entsize
            rows.append({name: struct.unpack_from("<" + code, self.data, start + at)[0] for name, code, at in held})
        return rows

    def section(self, index: int) -> _Section | None:
        return self.sections[index] if 0 <= index < len(self.sections) else None


def _section_headers(data, base: int, size: int) -> "list[tuple] | str":
    """The section headers of the ELF64 at data[base:base + size], or why
    they cannot be read (a table that does not fit is a truncated file)."""
    header = _ELF_HEADER.unpack_from(data, base)
    shoff, shentsize, shnum = header[6], header[11], header[12]
    if shentsize < _SECTION.size or shnum > MAX_SECTIONS:
        return f"damaged CUDA core dump (section table: {shnum} entries of {shentsize} bytes)"
    if shoff + shnum * shentsize > size:
        return f"truncated CUDA core dump ({size} bytes; its section table ends at {shoff + shnum * shentsize})"
    return [_SECTION.unpack_from(data, base + shoff + i * shentsize) for i in range(shnum)]


def _functions(dump: _Dump, image: _Section) -> list[tuple[int, int, str]]:
    """(address, size, name) of the functions a relocated cubin's symbol table
    holds; none where the image is not a readable ELF."""
    data, base, size = dump.data, image.offset, image.size
    if base + size > len(data) or size < _ELF_HEADER.size or data[base: base + 4] != b"\x7fELF" or data[base + 4] != 2:
        return []
    sections = _section_headers(data, base, size)
    if isinstance(sections, str):
        return []
    shnum = len(sections)
    found = []
    for entry in sections:
        if entry[1] != SHT_SYMTAB or entry[9] < _SYMBOL.size or entry[6] >= shnum:
            continue
        names = sections[entry[6]]
        if entry[4] + entry[5] > size or names[4] + names[5] > size:
            continue
        for i in range(min(entry[5] // entry[9], MAX_SYMBOLS)):
            name, info, _, _, value, length = _SYMBOL.unpack_from(data, base + entry[4] + i * entry[9])
            if info & 0xF == STT_FUNC and name:
                found.append((value, length, dump._string(base + names[4], names[5], name)))
    return found


def demangle(names: list[str]) -> dict[str, str]:
    """Each C++ name as the system's c++filt reads it, where there is one; the
    names themselves otherwise (they are data to it, never code)."""
    tool = shutil.which("c++filt")
    mangled = [name for name in dict.fromkeys(names) if name.startswith("_Z") and "\n" not in name]
    if tool is None or not mangled:
        return {}
    try:
        done = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    readable = done.stdout.splitlines()
    return dict(zip(mangled, readable)) if done.returncode == 0 and len(readable) == len(mangled) else {}


def read_cuda_coredump(path: str) -> CoreDump:
    """The faults a CUDA core dump records, each with its kernel, launch and
    place; raises CoreDumpError for a file that is not one (or is damaged
    past reading)."""
    try:
        dump = _Dump(path)
    except (OSError, ValueError) as exc:  # unreadable, or a mapping refused
        raise CoreDumpError(f"{path}: cannot read ({exc})") from None
    except struct.error:
        raise CoreDumpError(f"{path}: damaged CUDA core dump") from None
    try:
        return _read(dump)
    finally:
        dump.data.close()


def _read(dump: _Dump) -> CoreDump:
    devices = {}
    for table in dump.of_type(SHT_DEV_TABLE):
        for index, row in enumerate(dump.rows(table, _DEVICE)):
            devices[index] = row
    # Grids by (device, grid id); modules' images by (device, context, handle).
    grids: dict = {}
    for table in dump.of_type(SHT_GRID_TABLE):
        for row in dump.rows(table, _GRID):
            grids[(table.info, row["gridId64"])] = row
    images: dict = {}
    for image in dump.of_type(SHT_RELF_IMG):
        modules = dump.section(image.link)
        if modules is None or modules.type != SHT_MOD_TABLE:
            continue
        rows = dump.rows(modules, _MODULE)
        if image.info < len(rows):
            images.setdefault(rows[image.info]["moduleHandle"], []).append(image)
    faults: list[tuple] = []
    for lanes in dump.of_type(SHT_LN_TABLE):
        warp_table = dump.section(lanes.link)
        place = _place(dump, warp_table, lanes.info)
        if place is None:
            continue
        for row in dump.rows(lanes, _LANE):
            if row["exception"] and len(faults) < MAX_FAULTS:
                faults.append((row["exception"], place, row))
    if not faults:  # the faulting warps may have exited: the SMs keep the exception (driver r555 on)
        for table in dump.of_type(SHT_SM_TABLE):
            for index, row in enumerate(dump.rows(table, _SM, base=_SM_BASE)):
                if row.get("exception") and len(faults) < MAX_FAULTS:
                    place = {"device": table.info, "sm": row["smId"], "warp": None, "cta": None,
                             "error_pc": row["errorPC"] if row.get("errorPCValid") else None}
                    faults.append((row["exception"], place, None))
    functions: dict = {}
    made = []
    for code, place, lane in faults:
        cta = place["cta"]
        grid = grids.get((place["device"], cta["gridId64"])) if cta is not None else None
        error_pc = place["error_pc"]
        pc = lane["virtualPC"] if lane is not None else None
        mangled = None
        if grid is not None:
            for image in images.get(grid["moduleHandle"], ()):
                if image.index not in functions:
                    functions[image.index] = _functions(dump, image)
                mangled = _kernel_at(functions[image.index], grid["functionEntry"], error_pc or pc)
                if mangled is not None:
                    break
        device = devices.get(place["device"], {})
        made.append(DeviceFault(
            exception=EXCEPTIONS.get(code, "UNKNOWN" if code == _UNKNOWN_EXCEPTION else f"code {code}"), code=code,
            kernel=mangled, mangled=mangled, device=place["device"], device_name=dump.string(device.get("devName", 0)),
            sm=place["sm"], warp=place["warp"], lane=lane["ln"] if lane is not None else None,
            grid=(grid["gridDimX"], grid["gridDimY"], grid["gridDimZ"]) if grid else None,
            block=(grid["blockDimX"], grid["blockDimY"], grid["blockDimZ"]) if grid else None,
            block_index=(cta["blockIdxX"], cta["blockIdxY"], cta["blockIdxZ"]) if cta else None,
            thread_index=(lane["threadIdxX"], lane["threadIdxY"], lane["threadIdxZ"]) if lane else None,
            error_pc=error_pc, pc=pc, grid_id=cta["gridId64"] if cta else None))
    readable = demangle([fault.mangled for fault in made if fault.mangled])
    for fault in made:
        fault.kernel = readable.get(fault.mangled, fault.mangled)
    named = _DUMP_NAME.fullmatch(os.path.basename(dump.path))
    meta = next((rows[0] for rows in (dump.rows(t, _META) for t in dump.of_type(SHT_META_DATA)) if rows), None)
    when = meta["timestamp"] if meta and meta["timestamp"] else None
    if when is None and named is not None and named["time"].isdigit():
        when = int(named["time"])
    driver = (f"{meta['driverVersionMajor']}.{meta['driverVersionMinor']} (CUDA {meta['cudaDriverVersionMajor']}."
              f"{meta['cudaDriverVersionMinor']})") if meta else None
    return CoreDump(dump.path, named["host"] if named else None, int(named["pid"]) if named else None,
                    when if when is not None else int(os.path.getmtime(dump.path)), driver, made, dump.notes)


def _place(dump: _Dump, warp_table: _Section | None, warp_index: int) -> dict | None:
    """The device, SM, block and warp of a lane table, through the tables'
    links (warp table -> block table -> SM table -> device table)."""
    if warp_table is None or warp_table.type != SHT_WP_TABLE:
        return None
    warps = dump.rows(warp_table, _WARP)
    ctas = dump.section(warp_table.link)
    if warp_index >= len(warps) or ctas is None or ctas.type != SHT_CTA_TABLE:
        return None
    blocks = dump.rows(ctas, _CTA)
    sms = dump.section(ctas.link)
    if warp_table.info >= len(blocks) or sms is None or sms.type != SHT_SM_TABLE:
        return None
    sm_rows = dump.rows(sms, _SM, base=_SM_BASE)
    if ctas.info >= len(sm_rows):
        return None
    warp = warps[warp_index]
    return {"device": sms.info, "sm": sm_rows[ctas.info]["smId"], "warp": warp["warpId"],
            "cta": blocks[warp_table.info], "error_pc": warp["errorPC"] if warp["errorPCValid"] else None}


def _kernel_at(functions: list, entry: int, pc: int | None) -> str | None:
    """The function at the grid's entry address, else the one holding the PC."""
    for address, _, name in functions:
        if address == entry:
            return name
    if pc is not None:
        for address, size, name in functions:
            if address <= pc < address + size:
                return name
    return None
