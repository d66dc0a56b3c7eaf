"""Cases of `/weight_checker`: checksums, compare against a baseline, and reset."""

from __future__ import annotations

import re
from typing import Any

from weightsync.conformance._case import Case
from weightsync.conformance._probe import CaseFailed, Probe, expect_ok, expect_refusal

# vLLM's checksum keys: `dp{i}:pp{j}:pcp{k}:tp{l}:` then the parameter's name.
_VLLM_KEY = re.compile(r"^dp\d+:pp\d+:pcp\d+:tp\d+:")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# SHA-256 of no bytes: the digest of a weight that holds none.
_EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def checksums(probe: Probe) -> dict[str, str]:
    """The server's `{key: digest}`, or `CaseFailed`."""
    sums = expect_ok(probe.call("POST", "/weight_checker", json_body={"action": "checksum"}),
                     checksums=...)["checksums"]  # fmt: skip
    if not isinstance(sums, dict) or not sums:
        raise CaseFailed(f"checksums is not a non-empty object: {sums!r}"[:200])
    bad = [key for key, digest in sums.items() if not _SHA256_HEX.fullmatch(str(digest))]
    if bad:
        raise CaseFailed(f"digests that are not SHA-256 hex: {bad[:3]}")
    return dict(sums)


def _compare(probe: Probe, baseline: dict[str, str]) -> dict[str, Any]:
    answer = probe.call(
        "POST", "/weight_checker", json_body={"action": "compare", "baseline": baseline}
    )
    return expect_ok(answer, match=..., mismatches=...)


def _checksum(probe: Probe) -> str:
    sums = checksums(probe)
    form = "vLLM's dp:pp:pcp:tp: prefix" if all(map(_VLLM_KEY.match, sums)) else "bare names"
    return f"{len(sums)} SHA-256 digests, keys in {form} (e.g. {next(iter(sums))!r})"


def _checksum_covers_bytes(probe: Probe) -> str:
    sums = checksums(probe)
    empty = sorted(key for key, digest in sums.items() if digest == _EMPTY_DIGEST)
    if empty:
        raise CaseFailed(
            f"{len(empty)} of {len(sums)} digests are of zero bytes, so compare cannot see "
            f"them change (e.g. {empty[0]!r})"
        )
    return f"{len(sums)} digests, none of an empty weight"


def _compare_same(probe: Probe) -> str:
    body = _compare(probe, checksums(probe))
    if body["match"] is not True or body["mismatches"] != []:
        raise CaseFailed(f"its own checksums do not match: {body}")
    return str(body)


def _compare_changed(probe: Probe) -> str:
    sums = checksums(probe)
    changed = sorted(sums)[0]
    extra = "conformance.not_a_weight"
    body = _compare(probe, {**sums, changed: "0" * 64, extra: "0" * 64})
    if body["match"] is not False or sorted(body["mismatches"]) != sorted([changed, extra]):
        raise CaseFailed(f"expected mismatches [{changed!r}, {extra!r}], got {body}")
    return f"a changed digest and an unknown key: {body}"


def _compare_vllm_keys(probe: Probe) -> str:
    sums = checksums(probe)
    prefixed = {(k if _VLLM_KEY.match(k) else f"dp0:pp0:pcp0:tp0:{k}"): d for k, d in sums.items()}
    body = _compare(probe, prefixed)
    if body["match"] is not True:
        raise CaseFailed(f"a baseline keyed as vLLM keys it does not match: {body}"[:300])
    return "a baseline with vLLM's dp0:pp0:pcp0:tp0: keys matches"


def _compare_without_baseline(probe: Probe) -> str:
    answer = probe.call("POST", "/weight_checker", json_body={"action": "compare"})
    return expect_refusal(answer, (400, 422), mentions="baseline")


def _checker_bad_action(probe: Probe) -> str:
    answer = probe.call("POST", "/weight_checker", json_body={"action": "conformance"})
    return expect_refusal(answer, (400, 422), mentions="action")


def _reset_cycle(probe: Probe) -> str:
    before = checksums(probe)
    expect_ok(probe.call("POST", "/weight_checker", json_body={"action": "reset"}),
              status="reset")  # fmt: skip
    body = _compare(probe, before)
    if body["match"] is not False or not body["mismatches"]:
        raise CaseFailed(f"after reset, compare against the weights before it says {body}")
    return f"after reset, {len(body['mismatches'])} of {len(before)} weights differ"


CASES = [
    Case("weight_checker.checksum", "checksum answers {checksums: {key: SHA-256 hex}}", _checksum),
    Case(
        "weight_checker.checksums_cover_bytes",
        "no digest is of an empty weight (what compare cannot see change)",
        _checksum_covers_bytes,
    ),
    Case(
        "weight_checker.compare_same",
        "its own checksums match: {match: true, mismatches: []}",
        _compare_same,
    ),
    Case(
        "weight_checker.compare_changed",
        "a changed digest and an unknown key are the mismatches",
        _compare_changed,
    ),
    Case(
        "weight_checker.compare_vllm_keys",
        "a baseline keyed as vLLM keys (dp0:pp0:pcp0:tp0:name) is compared by name",
        _compare_vllm_keys,
    ),
    Case(
        "weight_checker.compare_without_baseline",
        "compare without a baseline is a typed 400",
        _compare_without_baseline,
    ),
    Case(
        "weight_checker.bad_action",
        "an unknown action is a typed 400 naming it",
        _checker_bad_action,
    ),
    Case(
        "weight_checker.reset_cycle",
        "after reset, compare against the weights before it "
        "lists mismatches (reset overwrites the weights)",
        _reset_cycle,
        kind="destructive",
    ),
]
