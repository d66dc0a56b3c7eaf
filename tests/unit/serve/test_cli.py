import os

import pytest

from weightsync import WeightValidationError
from weightsync.serve import cli
from weightsync.serve._parser import build_parser
from weightsync.serve.cli import _parse_serve_args, main


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--weight-transfer-config", '{"backend": "gloo"}'],
        ["serve", '--weight-transfer-config={"backend": "gloo"}'],
        ["serve", "--weight-transfer-config.backend", "gloo"],
        ["serve", "--weight-transfer-config.backend=gloo"],
    ],
)
def test_weight_transfer_config_in_json_and_dotted_forms(argv):
    args, config = _parse_serve_args(argv)
    assert config.backend == "gloo"
    assert args.model == "tiny"


def test_options_reach_the_namespace():
    args, config = _parse_serve_args(
        ["serve", "debug", "--port", "0", "--num-kv-blocks", "64", "--weight-update-staging"]
    )
    assert (args.model, args.port, args.num_kv_blocks, args.weight_update_staging) == (
        "debug", 0, 64, True,
    )  # fmt: skip
    assert config is None


def test_max_lora_versions_reaches_the_engine_config():
    from weightsync import EngineConfig
    from weightsync.serve.cli import _engine_config

    args, _ = _parse_serve_args(["serve", "debug", "--max-lora-versions", "2"])
    assert _engine_config(args).max_lora_versions == 2
    default, _ = _parse_serve_args(["serve", "debug"])
    assert _engine_config(default).max_lora_versions == EngineConfig().max_lora_versions


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(WeightValidationError, match="gloo"):
        _parse_serve_args(["serve", "--weight-transfer-config.backend", "carrier-pigeon"])


def test_keys_default_to_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "user")
    monkeypatch.setenv("WEIGHTSYNC_ADMIN_API_KEY", "admin")
    args = build_parser().parse_args(["serve"])
    assert (args.api_key, args.admin_api_key) == ("user", "admin")


def test_a_non_loopback_host_without_an_admin_key_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_ADMIN_API_KEY", raising=False)
    assert main(["serve", "debug", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--admin-api-key" in err and err.count("\n") == 1


def test_help_lists_the_serve_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out


def test_the_parsers_defaults_are_the_engines_and_the_servers():
    from weightsync import EngineConfig
    from weightsync.serve.cli import _DTYPES
    from weightsync.serve.config import ServerConfig

    args = build_parser().parse_args(["serve"])
    defaults = EngineConfig()
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                 "enable_lora", "max_loras", "max_lora_rank"):  # fmt: skip
        assert getattr(args, name) == getattr(defaults, name), name
    assert args.max_request_bytes == ServerConfig().max_request_bytes
    assert set(build_parser().parse_args(["serve"]).__dict__) >= {"dtype", "device"}
    assert sorted(_DTYPES) == sorted(
        build_parser()
        ._subparsers._group_actions[0]
        .choices["serve"]
        ._option_string_actions["--dtype"]
        .choices
    )


def test_a_cuda_device_without_cuda_is_a_one_line_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the device exists")
    assert main(["serve", "debug", "--port", "0", "--device", "cuda"]) != 0
    err = capsys.readouterr().err
    assert "EngineConfig.device is 'cuda'" in err and err.count("\n") == 1


def test_lora_flags_in_vllms_two_forms():
    args = build_parser().parse_args([
        "serve", "debug", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
        "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}',
        '{"name": "base", "path": "/adapters/base", "base_model_name": null}',
    ])  # fmt: skip
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 4, 32)
    assert [(m.name, m.path) for m in args.lora_modules] == [
        ("sql", "/adapters/sql"), ("chat", "/adapters/chat"), ("base", "/adapters/base"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", '{"name": "x"}'], "must be name=path or a JSON object"),
        (["--lora-modules", "{not json"], "is neither name=path nor JSON"),
        (["--lora-modules", '{"name": "x", "path": 3}'], "with string fields 'name' and 'path'"),
        (["--max-loras", "0"], "expected an integer >= 1"),
    ],
)
def test_bad_lora_flags_are_one_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "debug", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/nonexistent/adapter"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/nonexistent/adapter"], "no adapter found"),
        (["--enable-lora", "--lora-modules", "debug=/x"], "is the served model's name"),
    ],
)
def test_lora_settings_that_cannot_serve_stop_the_server_at_start(capsys, argv, message):
    assert main(["serve", "debug", "--port", "0", "--num-kv-blocks", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("setting", "preset", "expected"),
    [
        ("always [madvise] never\n", None, "1"),
        ("[always] madvise never\n", None, "1"),
        ("always madvise [never]\n", None, None),  # the kernel offers none: nothing to ask for
        (None, None, None),  # no such file: a kernel without them, or not Linux
        ("always [madvise] never\n", "0", "0"),  # the user's choice stands
    ],
    ids=["madvise", "always", "never", "missing", "set-to-0"],
)
def test_huge_pages_are_asked_for_where_the_kernel_offers_them(
    tmp_path, monkeypatch, setting, preset, expected
):
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting, encoding="ascii")
    monkeypatch.setattr(cli, "_HUGE_PAGES_SETTING", path)
    if preset is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset)
    cli._large_tensors_on_huge_pages()
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == expected
