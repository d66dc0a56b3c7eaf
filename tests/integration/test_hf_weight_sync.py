"""A `transformers` model of each family updates a `weightsync serve` of its own directory.

The trainer holds the family's Hugging Face model, built from the served directory; it pushes
`named_parameters()` as they are, over gloo and over shared memory. Afterwards `/weight_checker`
gives the trainer's own digests, the version is the trainer's label, and the next greedy
completion is the one `transformers` generates from the trainer's weights (both in float64, so
that no kernel difference can split a near-tie).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_support import Server

from model_dirs import FAMILIES, write_model_dir
from weightsync import weight_checksums
from weightsync.trainer import HTTPEngineClient, create_weight_sender, sync_weights

transformers = pytest.importorskip("transformers")

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: write_model_dir(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_model_updates_the_server_by_name(model_dirs, family, backend):
    path = model_dirs[family]
    server = Server(str(path), "--port", "0", "--dtype", "float64", "--num-kv-blocks", "64",
                    "--weight-transfer-config.backend", backend)  # fmt: skip
    try:
        engine = HTTPEngineClient(server.base_url, timeout_s=TIMEOUT_S)
        trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        with torch.no_grad():  # a training step's worth of change to every weight
            generator = torch.Generator().manual_seed(1)
            for param in trainer.parameters():
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)
        digests = weight_checksums(trainer.named_parameters())
        assert engine.weight_checksums() != digests
        with create_weight_sender(backend, [engine], timeout_s=TIMEOUT_S) as sender:
            sync_weights(sender, trainer.named_parameters(), weight_version="step-1")
        assert engine.weight_checksums() == digests
        assert engine.compare_weights(digests) == []
        assert engine.weight_version == "step-1"

        body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
        choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
        choice = choice.json()["choices"][0]
        ids = torch.tensor([choice["prompt_token_ids"]])
        with torch.no_grad():
            expected = trainer.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=12)[0, ids.shape[1] :].tolist()  # fmt: skip
        assert choice["token_ids"] == expected
        assert set(choice["weight_versions"]) == {"step-1"}
        engine.close()
    finally:
        server.stop()
        server.kill()
