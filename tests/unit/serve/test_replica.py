"""A replica of a data-parallel server takes the front's options, but its own address and rank."""

from weightsync.serve._front.fleet import replica_argv, replica_device
from weightsync.serve.cli import _parse_serve_args


def test_a_replica_takes_the_fronts_options_but_its_own_address_keys_and_index():
    args, transfer = _parse_serve_args(["serve", "tiny", "--data-parallel-size", "2",
                                       "--admin-api-key", "secret", "--port", "9000",
                                       "--no-prefix-caching", "--weight-transfer-config.backend",
                                       "gloo"])  # fmt: skip
    argv = replica_argv(args, transfer)
    assert argv[0] == "tiny"
    assert "--no-prefix-caching" in argv
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    for own in ("--admin-api-key", "secret", "--port", "--data-parallel-size", "--worker-index"):
        assert own not in argv
    assert [replica_device("cuda", i) for i in range(2)] == ["cuda:0", "cuda:1"]
    assert replica_device("cpu", 1) == "cpu"


def test_a_replica_takes_the_fronts_lora_flags_as_the_front_parsed_them():
    front = ["serve", "tiny", "--data-parallel-size", "2", "--enable-lora", "--max-loras", "3",
             "--max-lora-rank", "8", "--max-lora-versions", "2",
             "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/a b/chat"}']  # fmt: skip
    args, transfer = _parse_serve_args(front)
    replica, _ = _parse_serve_args(["serve", *replica_argv(args, transfer)])
    for name in ("enable_lora", "max_loras", "max_lora_rank", "max_lora_versions", "lora_modules"):
        assert getattr(replica, name) == getattr(args, name), name
    assert [(m.name, m.path) for m in replica.lora_modules] == [
        ("sql", "/adapters/sql"), ("chat", "/a b/chat"),
    ]  # fmt: skip
