import torch
from torch import nn

from weightsync.transfer.base import TensorSpec
from weightsync.transfer.buckets import _direct_region, flatten_module, plan_buckets


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    model[1].to(torch.bfloat16)  # mixed dtypes in one buffer
    return model


def test_flatten_keeps_values_parameters_and_trainability():
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    buffer = flatten_module(model)
    for name, param in model.named_parameters():
        assert id(param) == ids[name] and torch.equal(param, before[name])
        assert param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2](model[0](torch.randn(4, 8))).sum().backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, before["0.weight"])
    # Updates happened in the flat buffer's memory: the layout survives training steps.
    assert model[0].weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_flat_layout_matches_every_bucket_plan():
    model = make_model()
    flatten_module(model)
    params = dict(model.named_parameters())
    specs = [TensorSpec.of(n, p) for n, p in params.items()]
    for bucket_size in (64, 300, 1 << 20):
        for bucket in plan_buckets(specs, bucket_size):
            assert _direct_region(bucket, [params[s.spec.name] for s in bucket.slots]) is not None
