"""specsweep-train-eagle --data text on a random-weight Llama built here (bench.tiny_models): the
offline corpus, the held-out rule, shards and checkpoint kept in the work folder, a second run
resuming from them, the running held-out estimate, and the refusals."""
import json

import pytest
import torch

from backends.native.train_eagle import expected_tokens_per_cycle, main
from backends.native.train_text import MIN_HELD_OUT_LINE, chunks, documents, held_out_lines


def test_documents_are_code_reference_and_package_prose_in_a_seeded_order():
    docs = documents(seed=3)
    assert set(docs) == {"code", "docs", "prose"} and all(len(d) > 10 for d in docs.values())
    assert any("def " in d for d in docs["code"][:5])
    assert documents(seed=3)["code"][:20] == docs["code"][:20] and documents(seed=4)["code"][:20] != docs["code"][:20]


def test_chunks_take_the_kinds_in_turn():
    kinds = {"code": ["c = 1\n" * 400], "prose": ["Some words here.\n" * 30]}
    got = [k for _, k, _ in chunks(kinds, lambda t: list(t.encode()), 64, set())]
    assert got[:4] == ["code", "prose", "code", "prose"]  # one of each in turn while both last
    assert set(got[8:]) == {"code"}  # then what is left of the longer kind


def test_chunks_skip_every_chunk_with_a_held_out_line_and_resume_by_index():
    line = "    this_line_marks_a_measured_prompt = compute_it(value)\n"
    docs = {"code": ["".join(f"x_{i} = {i}  # filler text for the chunker\n" for i in range(200)),
                     "a = 1\n" * 40 + line + "b = 2\n" * 40]}
    encode = lambda t: list(t.encode())  # noqa: E731  (bytes as tokens: no tokenizer needed)
    held = held_out_lines(["prompt text\n" + line])
    assert held == {line.strip()} and len(line.strip()) >= MIN_HELD_OUT_LINE
    got = list(chunks(docs, encode, 64, held))
    assert got and all(line.strip() not in bytes(ids).decode() for _, _, ids in got)
    assert all(len(ids) <= 64 for _, _, ids in got)
    every = list(chunks(docs, encode, 64, set()))
    assert len(every) > len(got)  # the held-out chunk was there, and was dropped
    later = list(chunks(docs, encode, 64, held, start=got[3][0]))
    assert later == got[3:]  # a resumed run continues at the chunk index it saved


def test_expected_tokens_per_cycle():
    assert expected_tokens_per_cycle([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens_per_cycle([0.0, 1.0, 1.0]) == 1.0


def _train(tiny_llama, out, *extra):
    return main(["--model", str(tiny_llama), "--out", str(out), "--data", "text", "--text-tokens", "1500",
                 "--data-dir", str(out.parent / "text-data"),
                 "--chunk-tokens", "48", "--draft-vocab", "256", "--depth", "2", "--eval-prompts", "1",
                 "--workloads", "code_edit", "chat", "--eval-every", "0.001", *extra])


@pytest.mark.full  # about 20 s: three training runs and their final checks
def test_text_recipe_trains_keeps_its_work_and_resumes(tiny_llama, tmp_path, capsys):
    out = tmp_path / "head"
    assert _train(tiny_llama, out, "--max-steps", "6") == 0
    first = json.loads((out / "specsweep_train.json").read_text())
    work, data = tmp_path / "head.work", tmp_path / "text-data"
    state = json.loads((data / "state.json").read_text())
    assert first["data"] == "text" and first["steps"] == 6 and first["data_tokens"] >= 1500
    assert state["tokens"] == first["data_tokens"] and set(state["by_kind"]) <= {"code", "docs", "prose"}
    assert first["held_out_sequences"] >= 1 and first["held_out_estimates"]  # printed as it trained
    assert "held-out acceptance estimate by draft position" in capsys.readouterr().out
    est = first["held_out_estimates"][-1]
    assert len(est["accuracy_by_position"]) == 2 and 1.0 <= est["expected_tokens_per_cycle"] <= 3.0
    assert first["held_out"]["prompts"] == 2 and 0.0 <= first["held_out"]["acceptance_rate"] <= 1.0
    shards = sorted(p.name for p in data.glob("shard-*.pt"))
    ckpt = torch.load(work / "checkpoint.pt")
    assert ckpt["step"] == 6

    # the same command again, to step 9: no new data (the target was reached), training continues
    assert _train(tiny_llama, out, "--max-steps", "9") == 0
    second = json.loads((out / "specsweep_train.json").read_text())
    assert second["steps"] == 9 and second["steps_this_run"] == 3
    assert sorted(p.name for p in data.glob("shard-*.pt")) == shards
    assert second["data_tokens"] == first["data_tokens"]
    assert len(second["held_out_estimates"]) > len(first["held_out_estimates"])  # the curve carries on

    # a P-EAGLE head trains on the same data (no new target passes) with a checkpoint of its own
    assert _train(tiny_llama, tmp_path / "p_head", "--parallel", "--max-steps", "2") == 0
    assert sorted(p.name for p in data.glob("shard-*.pt")) == shards
    assert torch.load(tmp_path / "p_head.work" / "checkpoint.pt")["step"] == 2

    # a second run on a folder in use is refused, naming it
    from backends.native import train_eagle

    train_eagle._hold(data)
    try:
        assert _train(tiny_llama, out, "--max-steps", "10") == 2
    finally:
        train_eagle._HELD.pop().close()
    assert f"another specsweep-train-eagle is using {data}" in capsys.readouterr().err

    # a work folder of another recipe is refused, naming the difference
    assert _train(tiny_llama, out, "--draft-vocab", "128", "--max-steps", "1") == 2
    assert "draft_vocab: 256 there, 128 now" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--budget", "1"], "--budget=1.0 is not valid"),
    (["--minutes", "5", "--budget", "30"], "--budget sets the training time itself"),
    (["--text-tokens", "0"], "--text-tokens=0 is not valid"),
    (["--work-dir", "/tmp/x"], "--work-dir and --data-dir are for --data text"),
    (["--eval-every", "0"], "--eval-every=0.0 is not valid"),
])
def test_bad_recipe_options_are_refused_before_any_model_loads(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent/model", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
