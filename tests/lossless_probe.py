"""The lossless check as a job runs it, for tests that call an adapter directly: no engine records
margins during a timed run, so a test that needs a decision's margin asks the engine afterwards,
through the same probe the harness uses (Backend.margins_across_shapes)."""
import pandas as pd

from bench.lossless import compare_outputs, weigh_divergences


def weighed_lossless(backend, prompt_ids, base_outputs, spec_outputs, k: int, tol: float = 0.05) -> dict:
    """The harness's verdict on two arms' BatchOutputs (request i of both arms answers prompt_ids[i],
    in order): divergences found, then weighed by the engine. Returns weigh_divergences' counts
    and the detail."""
    base = [r for o in base_outputs for r in o.requests]
    spec = [r for o in spec_outputs for r in o.requests]
    names = [f"r{i}" for i in range(len(base))]
    base_df = pd.DataFrame({"request_id": names, "repeat": 0, "prompt_token_ids": [list(p) for p in prompt_ids],
                            "output_token_ids": [list(r.output_token_ids) for r in base]})
    spec_df = pd.DataFrame({"request_id": names, "repeat": 0, "output_token_ids": [list(r.output_token_ids) for r in spec]})
    cfg = {"temperature": 0.0, "lossless_margin_tol": tol, "num_speculative_tokens": k}
    detail = compare_outputs(cfg, base_df, spec_df)[3]
    if not detail:
        return {"lossless": "true", "lossless_divergences": 0, "lossless_near_ties": 0, "lossless_shape_ties": 0,
                "detail": []}
    return {**weigh_divergences(backend, cfg, base_df, spec_df, detail, "test"), "detail": detail}


def clearest_decision(backend, prompt: list[int], output: list[int], other: int, start: int = 0) -> list[tuple[int, float]]:
    """Positions of a greedy output from `start` on, ranked by how far the engine (one forward of
    the whole prefix) put the chosen token ahead of `other`: [(position, margin)], clearest first."""
    margins = [(j, backend.margins_across_shapes(prompt + output[:j], output[j], other, [0])[0])
               for j in range(start, len(output))]
    return sorted(margins, key=lambda jm: -jm[1])


def native_margins(model, prefix: list[int], preferred: int, other: int, shapes=(1,)) -> list[float]:
    """The native engine's probe (engine.margins_across_shapes, what NativeBackend answers) on a
    model loaded directly, as engine-level tests hold one: log p(preferred) - log p(other) after
    prefix, per batch shape (1: a decode step's)."""
    from backends.native.engine import margins_across_shapes

    return margins_across_shapes(model, list(prefix), int(preferred), int(other), list(shapes))
