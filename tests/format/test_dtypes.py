"""The torch-free dtype table agrees with the installed torch, entry for entry."""

import pickle

import pytest
import torch
from torch.storage import _dtype_to_storage_type_map

from gtp_format import dtypes
from gtp_format.dtypes import DTYPES, MEMORY_FORMATS, TENSOR_LAYOUTS, from_torch


def _torch_dtypes() -> dict[str, torch.dtype]:
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def test_table_covers_every_torch_dtype_and_nothing_else():
    assert set(DTYPES) == set(_torch_dtypes())


@pytest.mark.parametrize("name", sorted(_torch_dtypes()))
def test_entry_matches_torch(name):
    t, d = _torch_dtypes()[name], DTYPES[name]
    assert d.itemsize == t.itemsize
    assert d.is_floating_point == t.is_floating_point
    assert d.is_complex == t.is_complex
    assert d.torch is t and from_torch(t) is d
    assert str(d) == str(t) and repr(d) == repr(t)
    assert d.storage == _dtype_to_storage_type_map().get(t)
    if d.kind in (dtypes.SIGNED, dtypes.UNSIGNED, dtypes.BOOL):
        assert t.is_signed == (d.kind == dtypes.SIGNED)


def test_safetensors_codes_match_the_safetensors_library():
    from safetensors.torch import _TYPES  # code -> torch dtype, as the library writes them

    for code, t in _TYPES.items():
        assert DTYPES[str(t).removeprefix("torch.")].safetensors == code
    codes = [d.safetensors for d in DTYPES.values() if d.safetensors]
    assert len(codes) == len(set(codes))


def test_layout_and_memory_format_names_match_torch():
    assert TENSOR_LAYOUTS == {str(v).removeprefix("torch.") for v in vars(torch).values()
                              if isinstance(v, torch.layout)}
    assert MEMORY_FORMATS == {str(v).removeprefix("torch.") for v in vars(torch).values()
                              if isinstance(v, torch.memory_format)}


def test_pickling_keeps_the_singleton():
    d = DTYPES["bfloat16"]
    assert pickle.loads(pickle.dumps(d)) is d
