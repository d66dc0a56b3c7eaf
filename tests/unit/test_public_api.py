import inspect

import weightsync

EXPECTED = [
    "GlooWeightTransferEngine",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "TensorSpec",
    "TrainerGroup",
    "TransferStats",
    "WeightSyncError",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightTransferUpdateInfo",
    "WeightValidationError",
    "create_engine",
    "flatten_module",
    "parse_weight_transfer_config",
    "register_engine",
    "trainer_init",
    "trainer_send_weights",
]


def test_all_is_pinned_and_sorted():
    assert sorted(weightsync.__all__) == sorted(EXPECTED)
    assert weightsync.__all__ == sorted(weightsync.__all__)


def test_every_public_name_has_a_docstring():
    for name in weightsync.__all__:
        obj = getattr(weightsync, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and callable(value):
                    assert inspect.getdoc(value), f"{name}.{member} has no docstring"
