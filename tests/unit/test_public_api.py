import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import weightsync
import weightsync.trainer

EXPECTED = [
    "AsyncEngine",
    "BroadcastWeightSender",
    "ByteTokenizer",
    "CompletionOutput",
    "DiskWeightTransferEngine",
    "DiskWeightTransferUpdateInfo",
    "EngineBusyError",
    "EngineClient",
    "EngineConfig",
    "EngineConfigError",
    "EngineProcess",
    "EngineStateError",
    "EngineTimeoutError",
    "IncompleteWeightUpdateError",
    "GlooWeightTransferEngine",
    "IPCTrainerSendWeightsArgs",
    "IPCTrainerSession",
    "IPCWeightSender",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
    "InvalidRequestError",
    "LLMEngine",
    "LlamaConfig",
    "LlamaForCausalLM",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NonFiniteWeightsError",
    "ReplicaUnavailableError",
    "RequestOutput",
    "SamplingParams",
    "TensorSpec",
    "TornWeightsError",
    "TrainerGroup",
    "TransferStats",
    "WeightSender",
    "WeightSyncError",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightTransferUpdateInfo",
    "WeightUpdateStateError",
    "WeightValidationError",
    "WeightVersionSpan",
    "WireParams",
    "call_each",
    "create_engine",
    "create_weight_sender",
    "flatten_module",
    "ipc_trainer_init",
    "ipc_trainer_send_weights",
    "parse_weight_transfer_config",
    "register_engine",
    "save_weight_dir",
    "sync_weights",
    "trainer_init",
    "trainer_send_weights",
    "weight_checksums",
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


# --- every public module ----------------------------------------------------------------------
# A module is public when no part of its dotted path starts with "_". Its `__all__` is its public
# API, and what the API reference renders; docstrings are read statically, as the docs read them.

griffe = pytest.importorskip(
    "griffe", reason="griffe comes with the docs tools: pip install -e '.[docs]'"
)

SRC = Path(__file__).resolve().parents[2] / "src"
NOT_API = {"logger"}  # module loggers are public by convention, not API


def _public_module_names() -> list[str]:
    names = ["weightsync"]
    for info in pkgutil.walk_packages(weightsync.__path__, "weightsync."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


MODULES = _public_module_names()


def test_the_server_api_is_its_app_and_command_not_its_routes():
    # The routes and their request models are private: the HTTP shapes are the server's API, on
    # the serving and OpenAPI pages; Python callers build the app or run the command.
    serve_modules = [name for name in MODULES if name.startswith("weightsync.serve")]
    assert serve_modules == [
        "weightsync.serve",
        "weightsync.serve.app",
        "weightsync.serve.cli",
        "weightsync.serve.config",
    ]


def _trainer_imports(module: str) -> set[str]:
    """The `weightsync.trainer` modules that a trainer module's source imports (anywhere in it)."""
    tree = ast.parse((SRC / "weightsync" / "trainer" / f"{module}.py").read_text())
    found = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    found |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    return {name for name in found if name.startswith("weightsync.trainer")}


def test_the_trainers_end_of_an_update_reads_in_one_module():
    # What an engine answers, one call on every engine, the senders and pause-send-resume are
    # one story, read top to bottom in `senders`; it leans on no other trainer module.
    update_names = [
        "BroadcastWeightSender",
        "EngineClient",
        "IPCWeightSender",
        "WeightSender",
        "call_each",
        "create_weight_sender",
        "sync_weights",
    ]
    homes = {name: getattr(weightsync.trainer, name).__module__ for name in update_names}
    assert homes == dict.fromkeys(update_names, "weightsync.trainer.senders")
    assert _trainer_imports("senders") == set()


def test_the_http_client_maps_error_answers_itself():
    # An error answer becomes its weightsync error inside the client that reads it; the only
    # trainer module the client leans on holds the completion bodies, which no update reads.
    assert _trainer_imports("http_client") == {"weightsync.trainer._completions"}


@pytest.fixture(scope="module")
def static_package():
    return griffe.load("weightsync", search_paths=[str(SRC)], resolve_aliases=True)


def _static(package, name: str):
    module = package
    for part in name.split(".")[1:]:
        module = module.modules[part]
    return module


def _has_docstring(obj) -> bool:
    return obj.docstring is not None and bool(obj.docstring.value.strip())


@pytest.mark.parametrize("name", MODULES)
def test_module_all_is_its_public_api(name, static_package):
    module = importlib.import_module(name)
    static = _static(static_package, name)
    assert _has_docstring(static), f"{name} has no module docstring"
    defined = {
        member
        for member, obj in static.members.items()
        if not member.startswith("_") and not obj.is_alias and not obj.is_module
    } - NOT_API
    exported = getattr(module, "__all__", None)
    if exported is None:
        assert not defined, f"{name} defines public names {sorted(defined)} but has no __all__"
        return
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    for member in exported:
        assert hasattr(module, member), f"{name}.__all__ names {member!r}, which does not exist"
    unexported = defined - set(exported)
    assert not unexported, (
        f"{name} defines public names outside __all__: {sorted(unexported)}; export them, or "
        "rename them with a leading underscore"
    )


@pytest.mark.parametrize("name", MODULES)
def test_module_api_is_documented(name, static_package):
    module = importlib.import_module(name)
    static = _static(static_package, name)
    missing = []
    for member in getattr(module, "__all__", []):
        obj = static[member]
        obj = obj.final_target if obj.is_alias else obj
        if not _has_docstring(obj):
            missing.append(member)
        if obj.is_class:
            missing += [
                f"{member}.{attr}"
                for attr, value in obj.members.items()
                if not attr.startswith("_")
                and not value.is_alias
                and value.is_function
                and not _has_docstring(value)
            ]
    assert not missing, f"{name}: no docstring on {missing}"
