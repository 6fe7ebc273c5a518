"""The lossless check of a job: under greedy decoding every output with speculation must equal the
baseline's, token for token. A divergence is then weighed by asking the engine (untimed, after
both arms were measured) how far apart the two tokens were (docs/metrics.md, "Losslessness")."""
from __future__ import annotations

import logging
import math

from . import metrics
from .backend import Backend

log = logging.getLogger("specsweep")
MAX_NUMERICS_PROBES = 32  # distinct divergences a job asks its engine about (each a few short forwards)


def finished(req):
    """The requests that were answered (under load a request may have failed: no output to compare)."""
    return req[req.error.isna()] if "error" in req.columns else req


def first_answers(base_req):
    """Per request, the baseline's first answered output (its first repeat's, where it was answered)."""
    return finished(base_req).sort_values("repeat", kind="stable").drop_duplicates("request_id").set_index("request_id")


def compare_outputs(c, base_req, spec_req):
    """Greedy: every spec output must equal the baseline's, token for token. Returns (verdict,
    divergences, near-ties, detail): each output that differs is a divergence, to be weighed
    (weigh_divergences) before it counts as a failure; near-ties are known only then (0 here)."""
    if c["temperature"] > 0:
        return "n/a", 0, 0, []
    ref = first_answers(base_req)
    detail = []
    for _, r in finished(spec_req).iterrows():
        if r.request_id not in ref.index:  # no baseline answer to hold it to (it failed in every repeat)
            continue
        i = metrics.first_divergence(list(r.output_token_ids), list(ref.loc[r.request_id].output_token_ids))
        if i is not None:
            detail.append({"request_id": r.request_id, "repeat": int(r["repeat"]), "position": i, "near_tie": False})
    return ("true" if not detail else "false"), len(detail), 0, detail


def weigh_divergences(backend: Backend, c: dict, base_req, spec_req, detail: list, job: str,
                      keep_going=lambda: True) -> dict:
    """Each greedy divergence asked of the engine once more, after the measured runs (untimed, so
    neither arm pays for it): the margin log p(baseline's token) - log p(method's token) as the
    next token after the baseline's prefix, with speculation off, under the batch shapes a verify
    of k + 1 tokens spans and the whole prefix at once (Backend.margins_across_shapes). Shape 1
    (the last token forwarded alone, its prefix cached) is a decode step, the baseline's own
    shape: a margin there below lossless_margin_tol is a near-tie. Where the shapes move the
    margin across zero or by at least its smallest value, the divergence is within the engine's
    own numerics (a verify batch is one more shape): a shape tie. Either is recorded, not a
    failure. Engines that cannot score a prefix, a probe that fails, and divergences past the
    first MAX_NUMERICS_PROBES distinct ones stay failures; the measured outputs are already
    written, so nothing here can lose them. `keep_going()` false re-raises a probe's exception
    (the job's own time limit went off inside it)."""
    ref = first_answers(base_req)
    spec_out = spec_req.set_index(["request_id", "repeat"]).output_token_ids
    shapes = list(range(1, c["num_speculative_tokens"] + 2)) + [0]
    asked: dict = {}
    log.info("%s: %d output(s) diverged from the baseline; asking the engine for the margins at those tokens", job,
             len(detail))
    for d in detail:
        base = list(ref.loc[d["request_id"]].output_token_ids)
        spec = list(spec_out.loc[(d["request_id"], d["repeat"])])
        i = d["position"]
        d.update(near_tie=False, shape_tie=False, decode_margin=math.nan)
        if i >= len(base) or i >= len(spec):  # one output ended early: no two tokens to weigh
            d["margins_across_shapes"] = None
            continue
        key = (d["request_id"], i, int(spec[i]))
        if key not in asked:
            if len(asked) >= MAX_NUMERICS_PROBES:
                d["margins_across_shapes"], d["probe"] = None, f"not asked: past the first {MAX_NUMERICS_PROBES}"
                continue
            prefix = [int(t) for t in ref.loc[d["request_id"]].prompt_token_ids] + [int(t) for t in base[:i]]
            asked[key] = _probe(backend, prefix, int(base[i]), int(spec[i]), shapes, keep_going)
        _weigh(d, asked[key], shapes, backend, c["lossless_margin_tol"])
    failures = sum(not d["near_tie"] and not d["shape_tie"] for d in detail)
    return {"lossless": "true" if failures == 0 else "false", "lossless_divergences": failures,
            "lossless_near_ties": sum(d["near_tie"] for d in detail),
            "lossless_shape_ties": sum(d["shape_tie"] and not d["near_tie"] for d in detail)}


def _probe(backend, prefix, base_token, spec_token, shapes, keep_going):
    """The engine's margins at one divergence, or why it could not give them."""
    try:
        return backend.margins_across_shapes(prefix, base_token, spec_token, shapes)
    except Exception as e:  # the engine could not answer: the divergence stays a failure, with why
        if not keep_going():
            raise
        return f"{type(e).__name__}: {e}"


def _weigh(d: dict, got, shapes, backend, tol: float) -> None:
    """One divergence's record from its margins: near-tie at the decode shape, or shape tie."""
    if isinstance(got, str) or got is None:
        d["margins_across_shapes"] = None
        d["probe"] = got or f"backend {backend.name} cannot score a prefix under chosen batch shapes"
        return
    d["shapes"], d["margins_across_shapes"] = shapes, [float(m) for m in got]  # shape 0: the whole prefix
    d["decode_margin"] = float(got[0])  # shape 1, a decode step's
    d["near_tie"] = math.isfinite(d["decode_margin"]) and d["decode_margin"] < tol
    d["shape_tie"] = metrics.within_engine_numerics(got)


def lossless_columns(backend: Backend, c: dict, got, forced: bool, job: str, keep_going=lambda: True) -> dict:
    """The row's lossless columns for a measured job (bench.measure.Measured): "n/a" without a
    method arm or where the verifier was told to accept a drawn count (not the target's output);
    else the outputs compared, and each divergence weighed."""
    if forced or not got.speculative:
        return {"lossless": "n/a"}
    verdict, diverged, ties, detail = compare_outputs(c, got.baseline.requests, got.method.requests)
    out = {"lossless": verdict, "lossless_divergences": diverged, "lossless_near_ties": ties,
           "lossless_detail": detail, "lossless_shape_ties": 0}
    if verdict == "false":
        out.update(weigh_divergences(backend, c, got.baseline.requests, got.method.requests, detail, job, keep_going))
    return out
