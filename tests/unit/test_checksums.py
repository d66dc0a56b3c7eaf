import hashlib

import pytest
import torch

from weightsync import weight_checksums

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4) * 0.75
    return values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_is_sha256_of_the_raw_bytes(dtype):
    tensor = _sample(dtype)
    # The reference bytes, built without the view under test: one byte per element of a uint8
    # reinterpretation, in row-major order.
    raw = bytes(tensor.reshape(-1).view(torch.uint8).tolist())
    assert len(raw) == tensor.numel() * tensor.element_size()
    assert weight_checksums({"w": tensor}) == {"w": hashlib.sha256(raw).hexdigest()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_byte_equal_tensors_give_equal_digests(dtype):
    assert weight_checksums({"w": _sample(dtype)}) == weight_checksums({"w": _sample(dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_one_changed_element_changes_the_digest(dtype):
    tensor = _sample(dtype)
    changed = tensor.clone()
    changed[2, 3] = 1 if changed[2, 3] != 1 else 2
    assert weight_checksums({"w": tensor}) != weight_checksums({"w": changed})


def test_a_non_contiguous_tensor_hashes_as_its_contiguous_copy():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not tensor.is_contiguous()
    assert weight_checksums({"t": tensor}) == weight_checksums({"t": tensor.contiguous()})
    assert weight_checksums({"t": tensor}) != weight_checksums({"t": tensor.t()})


def test_a_slice_hashes_only_its_own_bytes():
    base = torch.arange(10, dtype=torch.float32)
    assert weight_checksums({"s": base[2:5]}) == weight_checksums({"s": torch.tensor([2.0, 3, 4])})


def test_pairs_and_mappings_give_the_same_digests_in_order():
    model = torch.nn.Linear(3, 2)
    from_pairs = weight_checksums(model.named_parameters())
    from_mapping = weight_checksums(dict(model.named_parameters()))
    assert from_pairs == from_mapping
    assert list(from_pairs) == ["weight", "bias"]


def test_an_empty_tensor_hashes_as_no_bytes():
    empty = hashlib.sha256(b"").hexdigest()
    assert weight_checksums({"e": torch.empty(0, 4, dtype=torch.bfloat16)}) == {"e": empty}


def test_a_tensor_that_requires_grad_is_hashed_without_autograd():
    weight = torch.ones(2, 2, requires_grad=True)
    assert weight_checksums({"w": weight}) == weight_checksums({"w": torch.ones(2, 2)})
