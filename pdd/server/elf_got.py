"""One imported function of a loaded shared library pointed elsewhere, through its GOT slot.

A shared library calls a function it imports (``malloc_trim``) through a slot of its global
offset table that the dynamic linker fills with the function's address. ``redirect`` finds the
library's slots for a symbol from its ELF relocations (``.rela.plt`` / ``.rela.dyn``: jump slots
and GOT entries naming the symbol) and writes another function's address there; every later
call from that library — and only from it — goes to the other function.

Used once, by ``pdd.server.heap`` (the reason is there). Only 64-bit little-endian ELF on x86-64
and AArch64 is read; anything else, or a library not loaded in this process, raises
``LookupError`` before anything is written.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

_EM_X86_64, _EM_AARCH64 = 62, 183
# Relocation types that fill a GOT slot with a symbol's address: jump slot, GOT entry.
_SLOT_TYPES = {_EM_X86_64: (7, 6), _EM_AARCH64: (1026, 1025)}
_SHT_RELA, _SHT_DYNSYM = 4, 11
_PT_LOAD = 1
_PROT = {"r": mmap.PROT_READ, "w": mmap.PROT_WRITE, "x": mmap.PROT_EXEC}


def got_slots(image: bytes, symbol: str) -> list[int]:
    """Offsets from the load base of the GOT slots through which the ELF ``image`` calls
    ``symbol``."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise LookupError("not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", image, 18)
    if machine not in _SLOT_TYPES:
        raise LookupError(f"ELF machine {machine}: only x86-64 and AArch64 are read")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    if not shoff or not shnum:
        raise LookupError("the file has no section headers")
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)
    ]
    wanted, slots = symbol.encode(), []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != _SHT_RELA or sections[link][1] != _SHT_DYNSYM:
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for at in range(offset, offset + size, 24):  # Elf64_Rela
            r_offset, r_info, _ = struct.unpack_from("<QQq", image, at)
            if r_info & 0xFFFFFFFF not in _SLOT_TYPES[machine]:
                continue
            (st_name,) = struct.unpack_from("<I", image, symtab[4] + (r_info >> 32) * 24)
            start = strtab[4] + st_name
            if image[start : image.index(b"\0", start)] == wanted:
                slots.append(r_offset)
    return slots


def _first_load_vaddr(image: bytes) -> int:
    (phoff,) = struct.unpack_from("<Q", image, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", image, 0x36)
    for i in range(phnum):
        p_type, _, _, p_vaddr = struct.unpack_from("<IIQQ", image, phoff + i * phentsize)
        if p_type == _PT_LOAD:
            return int(p_vaddr)
    raise LookupError("the file has no loadable segment")


def _mappings(path: str) -> list[tuple[int, int, str, int]]:
    """(start, end, perms, file offset) of this process's mappings of ``path``."""
    real, found = os.path.realpath(path), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[1], int(fields[2], 16)))
    return found


def redirect(path: str, symbol: str, address: int) -> int:
    """Point the loaded library ``path``'s calls of ``symbol`` at ``address``; the number of
    slots written (0: the library does not import it)."""
    with open(path, "rb") as f:
        image = f.read()
    slots = got_slots(image, symbol)
    mapped = _mappings(path)
    heads = [m for m in mapped if m[3] == 0]
    if not heads:
        raise LookupError(f"{path} is not loaded in this process")
    if _first_load_vaddr(image) != 0:
        raise LookupError(f"{path}: its first segment is not at address 0")
    base, page = heads[0][0], mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for offset in slots:
        slot = base + offset
        perms = next((m[2] for m in mapped if m[0] <= slot < m[1]), None)
        if perms is None:
            raise LookupError(f"{path}: GOT slot {offset:#x} is not mapped")
        prot = sum(_PROT[c] for c in perms[:3] if c in _PROT)
        start = slot & ~(page - 1)
        # NOTE: a slot written at load time is read-only afterwards (RELRO): writable for the
        # one aligned 8-byte store, then as it was.
        if libc.mprotect(start, page, prot | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), f"mprotect of {path}'s GOT")
        ctypes.c_uint64.from_address(slot).value = address
        libc.mprotect(start, page, prot)
    return len(slots)
