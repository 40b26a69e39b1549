"""``pdd.server.elf_got``: a library's GOT slots for a symbol, and what is refused."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from pdd.server import elf_got


def test_what_is_not_an_elf_file_is_refused():
    with pytest.raises(LookupError, match="not a 64-bit"):
        elf_got.got_slots(b"MZ" + bytes(100), "malloc_trim")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF")
def test_a_library_that_is_not_loaded_is_refused(tmp_path):
    import google._upb._message as upb

    copy = tmp_path / "copy.so"
    copy.write_bytes(open(upb.__file__, "rb").read())
    with pytest.raises(LookupError, match="not loaded"):
        elf_got.redirect(str(copy), "malloc_trim", 1)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
    reason="an ELF GOT on x86-64 / AArch64",
)
def test_upbs_malloc_trim_slot_is_found_and_points_where_it_was_told():
    import google._upb._message as upb

    image = open(upb.__file__, "rb").read()
    slots = elf_got.got_slots(image, "malloc_trim")
    assert len(slots) == 1 and elf_got.got_slots(image, "no_such_symbol_anywhere") == []
    noop = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value
    assert elf_got.redirect(upb.__file__, "malloc_trim", noop) == 1
    base = next(m[0] for m in elf_got._mappings(upb.__file__) if m[3] == 0)
    assert ctypes.c_uint64.from_address(base + slots[0]).value == noop
