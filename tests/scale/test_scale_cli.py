"""``treadle plan`` and ``treadle simulate`` on the command line: tables, JSON, plots and
response lengths read from a run's buffer."""

import contextlib
import json
import os
import random
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treadle.cli import main
from treadle.scale.hardware import gpu
from treadle.scale.plan import Question, plan
from treadle.scale.plots import memory_bars
from treadle.scale.published import ROWS
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate

PLAN = ["plan", "qwen2.5-7b", "--gpu", "h100", "--gpus", "8", "--max-response", "8192"]


def test_plan_table_names_each_placement_and_the_best_ones_roles(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "disagg 4:4 async" in out and "colocated sync" in out
    roles = [line.split()[0] for line in out.splitlines() if line.split()[:1] in
             (["policy"], ["reference"], ["engine"])]  # fmt: skip
    assert roles == ["policy", "reference", "engine"]
    assert "GiB t/e: a training GPU's peak / an engine GPU's" in out


def test_plan_json_gives_each_roles_terms_summing_to_its_total(capsys):
    assert main([*PLAN, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3  # colocated, and the 4:4 and 2:6 splits (6:2 does not fit)
    for row in rows:
        for role, terms in row["memory_gib"].items():
            total = terms.pop("total")
            assert sum(terms.values()) == pytest.approx(total), role
        assert row["simulated"]["step_s"] > 0
    rates = [r["simulated"]["tokens_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True)  # most trained tokens per second first
    # every engine GPU holds the 0.85 x 79.6 = 67.66 GiB the engine reserves (colocated: the
    # trainer's states beside the engine within it), as the plot draws it
    assert [r["engine_peak_gib"] for r in rows] == pytest.approx([67.66] * 3, abs=0.01)


def test_memory_plot_bars_hold_each_phase_on_its_gpus(tmp_path):
    q = Question(NAMED["qwen2.5-7b"], gpu("h100"), 8, Workload(64, 8, 512, Lengths(2730, 8192)))
    placements = plan(q, steps=2)
    colocated = next(p for p in placements if p.kind == "colocated")
    (rollout_label, rollout), (update_label, update) = memory_bars(colocated)
    assert (rollout_label, update_label) == ("rollout", "update")
    assert rollout["activations"] == 0 and update["kv_cache"] == 0  # the engine asleep
    engine = next(b for b in colocated.memory if b.role == "engine")
    policy, reference = (b for b in colocated.memory if b.role != "engine")
    # rollout: the trainer roles' parameter shards beside the engine's weights (no layer is
    # gathered while the engine runs)
    shards = policy.parameters - policy.gathered + reference.parameters - reference.gathered
    assert rollout["parameters"] == pytest.approx(shards + engine.parameters)
    # update: the policy's pass is the larger, and the reference's logits are freed by then
    assert (update["activations"], update["logits"]) == (policy.activations, policy.logits)
    assert update["parameters"] == pytest.approx(shards + policy.gathered)
    from treadle.scale.plots import memory

    path = memory(placements, 79.6, tmp_path / "m.png")
    assert path.stat().st_size > 10_000


def test_simulate_prints_a_table(capsys):
    assert main(["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert "staleness mean / max" in out and "0.00 / 0" in out  # sync: nothing stale


def _buffer(run, responses, prompt, group_size=None):
    (run / "buffer").mkdir(parents=True)
    columns = {
        "token_ids": [[1] * (prompt + n) for n in responses],
        "prompt_tokens": [prompt] * len(responses),
    }
    if group_size:  # the buffer's group column: rollouts k * size .. k * size + size - 1
        columns["group"] = [i // group_size for i in range(len(responses))]
    pq.write_table(pa.table(columns), run / "buffer" / "step_000001.parquet")


def test_simulate_draws_lengths_from_a_runs_buffer(tmp_path, capsys):
    # 16 rollouts in 4 groups of 4: three groups of 10 tokens, one of 300, after 20-token prompts
    responses = [10] * 12 + [300] * 4
    _buffer(tmp_path, responses, 20, group_size=4)
    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "4", "--samples", "4",
            "--lengths-from", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    groups = ((10,) * 4,) * 3 + ((300,) * 4,)
    # the default roles' forwards: the old policy's and the reference's
    work = Workload(4, 4, 20, Lengths(sum(responses) / 16, 300, measured=groups), extra_forwards=2)
    direct = simulate(NAMED["qwen2.5-0.5b"], work, Setup(gpu("h100"), 2, 2, colocated=True),
                      steps=None)  # fmt: skip  # the CLI's default: to the steady state
    assert row["step_s"] == pytest.approx(direct.step_s)
    # trained tokens per step: 16 x 20 prompt tokens + 16 drawn responses of 10 or 300 each
    tokens = row["tokens_per_s"] * row["step_s"]
    assert 16 * 10 <= tokens - 16 * 20 <= 16 * 300
    # a prompt's samples are drawn together: every group of 4 drawn is one measured group
    drawn = work.lengths.draw(random.Random(0), 50, 4)
    assert {tuple(drawn[k : k + 4]) for k in range(0, 200, 4)} == {(10,) * 4, (300,) * 4}
    # a measured prompt with no lengths is refused where it is made, not when drawn
    with pytest.raises(ValueError, match=r"prompt 1 has no lengths"):
        Lengths(10, 300, measured=((10,), ()))


def _run_dir(run, overrides=(), reward_model=False):
    """A run folder with a one-step buffer and the config.yaml treadle train writes."""
    import yaml

    from treadle.config import load_config
    from treadle.config.loading import to_dict

    _buffer(run, [10] * 16, 20, group_size=4)
    cfg = to_dict(load_config("recipes/default.yaml", list(overrides)))
    if reward_model:
        cfg["reward"]["functions"].append({"name": "reward_model", "params": {"path": "rm"}})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


RUN_ARGV = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "4", "--samples", "4",
            "--json", "--steps", "2", "--lengths-from"]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "reward_model", "roles", "forwards"),
    [
        ([], False, ("policy", "engine"), 0),  # the default recipe: no KL, no importance sampling
        (["algorithm.importance_sampling=tis_token", "algorithm.kl.coef=0.1"], False,
         ("policy", "reference", "engine"), 2),
        (["algorithm.advantage=gae"], False, ("policy", "critic", "engine"), 1),
        ([], True, ("policy", "reward", "engine"), 1),
        (["algorithm.advantage=remax"], False, ("policy", "engine"), 0),
        (["model.lora.r=16", "algorithm.kl.coef=0.05"], False, ("policy", "reference", "engine"),
         1),
        (["model.lora.r=16", "model.lora.sync=adapter"], False, ("policy", "engine"), 0),
    ],
)  # fmt: skip
def test_lengths_from_a_run_take_its_roles_and_forwards(tmp_path, capsys, overrides, reward_model,
                                                         roles, forwards):  # fmt: skip
    # the run's config.yaml: a reference where kl.coef > 0, a critic for gae (its values'
    # forward), a reward model's scores, the old policy's forward unless importance_sampling
    # is none; ReMax's greedy response a prompt
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _roles_and_forwards, _workload
    from treadle.jobs.scale_runs import run_roles

    run = _run_dir(tmp_path, overrides, reward_model)
    remax, lora = "algorithm.advantage=remax" in overrides, 16 * ("model.lora.r=16" in overrides)
    sync = "adapter" if "model.lora.sync=adapter" in overrides else "merged"
    assert run_roles(run) == (roles, forwards, remax, lora, sync)
    assert main([*RUN_ARGV, str(run)]) == 0
    (said,) = capsys.readouterr().err.splitlines()  # one line, not wrapped
    greedy = "; a greedy response a prompt (ReMax), not trained" if remax else ""
    greedy += "; LoRA rank 16" if lora else ""
    greedy += ", its adapters synced alone" if sync == "adapter" else ""
    assert said == (f"roles from {run / 'config.yaml'}: {', '.join(roles)}; forwards besides "
                    f"the update's: {forwards}{greedy}")  # fmt: skip
    # --extra-forwards replaces the run's, and the line says so
    assert main([*RUN_ARGV, str(run), "--extra-forwards", "3"]) == 0
    assert capsys.readouterr().err.endswith(
        f"forwards besides the update's: 3 (--extra-forwards; the run's: {forwards}){greedy}\n"
    )
    # --roles given wins, with the forwards its roles run; the run's LoRA and ReMax hold
    args = _parse([*RUN_ARGV, str(run), "--roles", "policy,engine"])
    kept = "ReMax baseline" if remax else "LoRA rank" if lora else ""
    kept += " and LoRA adapter sync" if sync == "adapter" else ""
    source = f"--roles, with {run / 'config.yaml'}'s {kept}" if kept else ""
    assert _roles_and_forwards(args) == ((("policy", "engine"), 1, remax, lora, sync), False,
                                         source)  # fmt: skip
    # and the options given replace them: --lora-rank 0 trains every weight, synced merged
    args = _parse([*RUN_ARGV, str(run), "--lora-rank", "0", "--no-greedy-baseline"])
    work = _workload(args, roles, run_roles(run))
    assert (work.lora_rank, work.greedy_baseline, work.lora_sync) == (0, False, "merged")
    assert main([*RUN_ARGV, str(run), "--lora-rank", "0"]) == 0
    # a rank given with --roles keeps the run's sync, though the ReMax baseline is given too
    args = _parse([*RUN_ARGV, str(run), "--roles", "policy,engine", "--lora-rank", "8",
                   "--no-greedy-baseline"])  # fmt: skip
    assert _roles_and_forwards(args)[0].lora_sync == sync


def test_lengths_from_a_buffer_without_a_config_uses_the_default_roles(tmp_path, capsys):
    _buffer(tmp_path, [10] * 16, 20, group_size=4)
    assert main([*RUN_ARGV, str(tmp_path)]) == 0
    assert capsys.readouterr().err == (
        f"{tmp_path} has no config.yaml: the default roles: policy, reference, engine; forwards "
        "besides the update's: 2\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "qwen2.5-0.5b", "--train-pp", "3"],  # check(): the layout
        ["simulate", "qwen2.5-0.5b", "--gpus", "1", "--prompt-tokens", "400000"],  # check_fits
        ["plan", "qwen2.5-0.5b", "--ep", "2"],  # a dense model
        ["plan", "qwen2.5-0.5b", "--tp", "3"],  # 14 heads
    ],
)
def test_a_refusal_with_lengths_from_is_one_line_without_the_roles_note(tmp_path, capsys, argv):
    # the line saying where the roles came from is printed once the input is known good: a
    # refusal stays the one line on stderr; a plan that runs prints the note once
    run = _run_dir(tmp_path)
    assert main([*argv, "--lengths-from", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("treadle: error: ") and "roles from" not in line, line
    plan = ["plan", "qwen2.5-0.5b", "--steps", "2", "--json", "--lengths-from", str(run)]
    assert main(plan) == 0
    assert capsys.readouterr().err == (f"roles from {run / 'config.yaml'}: policy, engine; "
                                       "forwards besides the update's: 0\n")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"\xff\xfe", "cannot read"),  # not UTF-8
        (b"foo: [unclosed", "cannot read"),  # not YAML: one line all the same
        (b"", "holds no run config"),
        (b"- a list", "holds no run config"),
        (b"algorithm: {advantage: nonsense}", "algorithm.advantage"),
        # a quoted rank is a string, as treadle train reads the file: refused, not coerced
        (b"model: {lora: {r: '16'}}", "config model.lora.r: expected int, got str '16'"),
        (b"a: " + b"[" * 2000 + b"]" * 2000, "cannot read"),  # nested past Python's recursion
        (b"algorithm: {kl: [1, 2]}", "algorithm.kl is a list, not a section"),
        (b"model: {lora: {r: 5000}}", "model.lora.r 5000 is above the largest LoRA rank, 4,096"),
        (b"model: {lora: {r: %d}}" % 10**43, "model.lora.r 100000... (44 digits) is above the"),
        (b"model: {lora: [1]}", "model.lora is a list, not a section"),
        (b"reward: {functions: reward_model}", "reward.functions is a string, not a list"),
        # aliases nested 9 deep make 10^9 values once expanded: refused before, in a moment
        (
            b"a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                b"a%d: &a%d [" % (i, i) + b", ".join([b"*a%d" % (i - 1)] * 10) + b"]\n"
                for i in range(1, 9)
            )
            + b"model: {lora: {r: *a8}}",
            "model.lora.r is a list, not a value",
        ),
    ],
)
def test_lengths_from_a_damaged_config_is_one_line_naming_it_and_roles(tmp_path, capsys, text,
                                                                        says):  # fmt: skip
    _buffer(tmp_path, [10] * 16, 20, group_size=4)
    (tmp_path / "config.yaml").write_bytes(text)
    assert main([*RUN_ARGV, str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("treadle: error: --lengths-from: ") and says in line, line
    assert str(tmp_path / "config.yaml") in line and line.endswith("give the run's roles instead")
    # with --roles it is still read, for the run's LoRA and ReMax, unless both are given
    roles = [*RUN_ARGV, str(tmp_path), "--roles", "policy,engine"]
    assert main(roles) == 2
    assert capsys.readouterr().err.rstrip().endswith("--greedy-baseline or --no-greedy-baseline "
                                                     "are given")  # fmt: skip
    assert main([*roles, "--lora-rank", "0", "--no-greedy-baseline"]) == 0


def test_lengths_from_a_run_whose_lora_keys_are_given_does_not_read_them(tmp_path, capsys):
    # the run's model.lora.r 5000 is refused (above 4,096) only while it would be used: with
    # --lora-rank given the file's rank is neither read nor checked, with or without --roles
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _roles_and_forwards

    _buffer(tmp_path, [10] * 16, 20, group_size=4)
    (tmp_path / "config.yaml").write_bytes(b"model: {lora: {r: 5000, sync: adapter}}")
    assert main([*RUN_ARGV, str(tmp_path)]) == 2
    assert "model.lora.r 5000 is above the largest LoRA rank" in capsys.readouterr().err
    for roles in ([], ["--roles", "policy,engine", "--no-greedy-baseline"]):
        args = _parse([*RUN_ARGV, str(tmp_path), "--lora-rank", "8", *roles])
        run = _roles_and_forwards(args)[0]
        assert (run.lora_rank, run.lora_sync) == (0, "adapter")  # the file's sync still read
        assert main([*RUN_ARGV, str(tmp_path), "--lora-rank", "8", *roles]) == 0
        assert "LoRA rank 8, its adapters synced alone" in capsys.readouterr().err
    # --lora-sync alone leaves the rank the file's: still refused
    assert main([*RUN_ARGV, str(tmp_path), "--lora-sync", "merged"]) == 2
    assert "model.lora.r 5000" in capsys.readouterr().err
    # both given: a model.lora that is no section is not read either
    (tmp_path / "config.yaml").write_bytes(b"model: {lora: [1]}")
    assert main([*RUN_ARGV, str(tmp_path), "--lora-rank", "8", "--lora-sync", "merged"]) == 0


def test_lengths_from_an_older_runs_config_reads_only_the_keys_it_needs(tmp_path):
    # a key this treadle does not know (another version's) is no reason to refuse
    import yaml

    from treadle.jobs.scale_runs import run_roles

    run = _run_dir(tmp_path, ["algorithm.kl.coef=0.05"])
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["rollout"]["a_removed_key"] = 3
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert run_roles(run) == (("policy", "reference", "engine"), 1, False, 0, "merged")


def test_lengths_from_a_buffer_without_groups_draws_each_rollout_alone(tmp_path):
    from treadle.jobs.scale_runs import run_lengths

    _buffer(tmp_path, [10] * 12 + [300] * 4, 20)
    groups, prompts = run_lengths(tmp_path)
    assert groups == [(10,)] * 12 + [(300,)] * 4 and prompts == [20] * 16


def test_lengths_from_a_foreign_table_is_refused_by_its_column_type(tmp_path, capsys):
    # token_ids as lists of lists: len() of each row would read as a 1-token response
    (tmp_path / "buffer").mkdir()
    table = pa.table({"token_ids": [[[1, 2], [3]]], "prompt_tokens": [1]})
    pq.write_table(table, tmp_path / "buffer" / "step_000001.parquet")
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "its token_ids are list<element: list<element: int64>>, not lists of" in line
    # prompt_tokens as floats or booleans: no count of tokens (True would read as 1)
    for prompt in (20.0, True):
        table = pa.table({"token_ids": [[1] * 30], "prompt_tokens": [prompt]})
        pq.write_table(table, tmp_path / "buffer" / "step_000001.parquet")
        assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"prompt_tokens ({prompt!r}) is not a whole count of tokens" in line


def test_a_plot_name_of_255_bytes_is_written(tmp_path, capsys):
    # the temporary file beside it has a short name of its own, so any legal name is written
    path = tmp_path / ("c" * 251 + ".png")
    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "4", "--samples", "4",
            "--steps", "2", "--plot", str(path)]  # fmt: skip
    assert main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lengths_from_a_folder_without_a_buffer_is_one_line_exit_2(tmp_path, capsys):
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no buffer/step_*.parquet there" in line


def test_lengths_from_a_damaged_buffer_file_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "step_000001.parquet").write_bytes(b"not parquet")
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot read" in line and "step_000001.parquet" in line


def test_lengths_from_a_run_whose_lora_rank_outgrows_the_model_is_refused(tmp_path, capsys):
    # the run's rank 2,048 on qwen2.5-0.5b's 896-wide model, as --lora-rank 2048 would be
    _buffer(tmp_path, [10] * 16, 20, group_size=4)
    (tmp_path / "config.yaml").write_text("model: {lora: {r: 2048}}\n")
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--lengths-from {tmp_path}: model.lora.r 2048: more than qwen2.5-0.5b's hidden" in line


def test_lengths_from_a_fifo_in_the_buffer_is_refused_not_read(tmp_path, capsys):
    # opening a FIFO blocks until a writer comes, where no signal handler runs: never open it
    _buffer(tmp_path, [10] * 4, 20)
    os.mkfifo(tmp_path / "buffer" / "step_000002.parquet")
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "step_000002.parquet is not a regular file" in line


def test_expert_parallel_1_on_a_dense_model_is_no_expert_parallelism(capsys):
    # Megatron's default expert_model_parallel_size, copied from a dense model's recipe: the
    # same simulation as without it (any other degree is refused: the model has no experts)
    assert main(["simulate", "qwen2.5-0.5b", "--json"]) == 0
    plain = capsys.readouterr().out
    assert main(["simulate", "qwen2.5-0.5b", "--train-ep", "1", "--json"]) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "qwen2.5-7b", "--gpus", "0"], "--gpus 0: must be 1..16,384"),
        (["simulate", "qwen2.5-0.5b", "--prompts", "0"], "--prompts 0 x --samples 8"),
        (["simulate", "qwen2.5-0.5b", "--max-response", "0"], "at least 1 token"),
        (["simulate", "qwen2.5-0.5b", "--mean-response", "nan"], "--mean-response nan"),
        # Python's float() spelling "infinity" reaches the same check as "inf"
        (["simulate", "qwen2.5-0.5b", "--mean-response", "infinity"], "--mean-response inf must"),
        (["simulate", "qwen2.5-0.5b", "--mean-response", "5000"], "at most --max-response 4096"),
        (
            [
                "simulate",
                "qwen2.5-0.5b",
                "--rollout-gpus",
                "1",
                "--mode",
                "async",
                "--staleness",
                "-1",
            ],
            "--staleness -1 must be in 0..64",
        ),
        (["simulate", "qwen2.5-0.5b", "--engine-tp", "0"], "--engine-tp 0 must be at least 1"),
        (["simulate", "qwen2.5-0.5b", "--rollout-gpus", "8"], "--rollout-gpus 8: the engines'"),
        (["simulate", "qwen2.5-0.5b", "--steps", "1"], "--steps 1: must be 2..64"),
        (["simulate", "qwen2.5-0.5b", "--updates-per-sync", "2"], "GPUs of their own"),
        (["simulate", "qwen2.5-0.5b", "--train-pp", "3"], "divide the 8 training GPUs"),
        (["simulate", "qwen2.5-0.5b", "--gpus", "64", "--train-pp", "32"], "than 24 layers"),
        # one engine GPU cannot hold 70B's 131 GiB of bf16 weights: the engine is named first
        (["simulate", "llama3.1-70b", "--gpus", "2"], "131.4 GiB of weights per GPU, fewer"),
        # the policy's resident 32.9 GiB (8.2 + 8.2 + 16.4 of parameter shards, gradients and
        # Adam moments over 32 ranks) and the frozen reference's 4.1 (70.55B x 2 bytes / 32),
        # plus the policy's pass: 5.1 of two gathered 856M-parameter layers and the
        # 1.05B-parameter output layer, 40.1 activations, 7.7 logits; 89.9 GiB held, 1 + 5%
        # more: 95.4 GiB; Ulysses 2 halves the activations and logits
        (
            ["simulate", "llama3.1-70b", "--gpus", "32", "--engine-tp", "8"],
            "needs 95.4 GiB per training GPU in tp1 pp1 over 32 x h100 (79.6 GiB): "
            "--train-tp 1 --train-pp 1 --train-sp 2 fits",
        ),
        (["simulate", "qwen2.5-0.5b", "--staleness", "2"], "applies to --mode async, not sync"),
        (
            ["simulate", "qwen2.5-0.5b", "--mode", "one_step", "--rollout-gpus", "2", "--partial"],
            "--partial applies to --mode async",
        ),
        # sequence parallel: Qwen2.5-0.5B's 14 heads take 1, 2, 7 or 14; 8 GPUs not 7
        (["simulate", "qwen2.5-0.5b", "--train-sp", "4"], "must divide qwen2.5-0.5b's 14 atten"),
        (["simulate", "qwen2.5-0.5b", "--train-sp", "3"], "x --train-sp 3 must be at least 1"),
        (["simulate", "qwen2.5-0.5b", "--train-sp", "1.5"], "invalid int value: '1.5'"),
        # expert parallel: a dense model has no experts; Qwen3-30B-A3B's 128 experts over 8
        # data-parallel ranks take 1, 2, 4 or 8
        (["simulate", "qwen2.5-0.5b", "--train-ep", "2"], "has no experts; leave --train-ep out"),
        (
            ["simulate", "qwen3-30b-a3b", "--train-ep", "16"],
            "--train-ep 16 must divide the trainer's 8 data-parallel ranks and qwen3-30b-a3b's "
            "128 experts: use --train-ep 1 or 2 or 4 or 8",
        ),
        (["simulate", "qwen3-30b-a3b", "--train-ep", "-2"], "use --train-ep 1 or 2 or 4 or 8"),
        # a layout refused with --train-ep 32 given names the tensor-parallel degrees that leave
        # 32 data-parallel ranks for it: tp 1 only, not 4, 8, 16 or 32
        (
            ["simulate", "qwen3-30b-a3b", "--gpus", "32", "--train-ep", "32", "--train-tp", "3"],
            "divide the 32 training GPUs; with --train-pp 1 --train-sp 1: --train-tp 1",
        ),
        # a trainer that does not fit at 16 GPUs, in a layout whose 16 ranks take the given
        # --train-ep 2: the fix keeps it (a smaller engine TP leaves room)
        (
            ["simulate", "qwen3-30b-a3b", "--gpus", "16", "--train-ep", "2"],
            "(79.6 GiB): --engine-tp 2 --train-tp 1 --train-pp 1 fits, or --offload",
        ),
        # a trainer that does not fit: the layout named instead, Ulysses 2, leaves 4 data-parallel
        # ranks, too few for the 8 expert ranks given, so it names the degree it was sized at
        (
            [
                "simulate",
                "qwen3-30b-a3b",
                "--gpus",
                "16",
                "--rollout-gpus",
                "8",
                "--train-ep",
                "8",
                "--mode",
                "async",
            ],
            "over 8 x h100 (79.6 GiB): --train-tp 1 --train-pp 1 --train-sp 2 --train-ep 4 fits",
        ),
        # a micro-batch of packed sequences holds one whole: 512 + 4,096 tokens by default
        (["simulate", "qwen2.5-0.5b", "--pack-tokens", "4000"], "less than one prompt + longest"),
        (["simulate", "qwen2.5-0.5b", "--pack-tokens", "-1"], "--pack-tokens -1: must be 0..16,7"),
        # 2,000,000 packed tokens hold the activations of ceil(2e6 / 16,896) = 119 sequences
        (
            [
                "simulate",
                "qwen2.5-7b",
                "--max-response",
                "16384",
                "--train-sp",
                "2",
                "--pack-tokens",
                "2000000",
            ],
            "tokens per sequence, packed 2,000,000 tokens a micro-batch needs",
        ),
        (
            ["simulate", "qwen2.5-0.5b", "--rollout-gpus", "4", "--sync-method", "colocated"],
            "updates engines on the trainer's own GPUs: omit --rollout-gpus",
        ),
        (["simulate", "qwen2.5-0.5b", "--sync-method", "nccl"], "invalid choice: 'nccl'"),
        (
            ["simulate", "qwen2.5-0.5b", "--rollout-gpus", "4", "--sync-method", "gathered"],
            "--sync-method gathered updates engines on the trainer's own GPUs",
        ),
        (["simulate", "qwen2.5-0.5b", "--spec-tokens", "1"], "--spec-tokens 1 needs --spec-acc"),
        (["simulate", "qwen2.5-0.5b", "--sync-seconds", "0"], "--sync-seconds 0: a measured"),
        (["simulate", "qwen2.5-0.5b", "--roles", "policy,reference"], "give both (e.g. policy,e"),
        (["simulate", "qwen2.5-0.5b", "--sync-seconds", "nan"], "--sync-seconds nan: a measured"),
        (["simulate", "qwen2.5-0.5b", "--rollout-gpus", "4", "--offload"], "--offload moves a co"),
        # DeepSeek-V3 on 256 H100s as NeMo-RL runs it, in GiB a GPU: the policy's shards,
        # gradients and Adam moments 39.06 (its experts 16-way expert parallel and not sharded
        # further) + the reference's 4.88 beside the engine's 1.342 TB / 32 = 39.06 of weights,
        # 1.0 of overhead and 0.10 of one sequence's KV cache = 84.10; another layout fits, or
        # these states offloaded to host memory while the engine generates
        (
            [
                "simulate",
                "deepseek-v3",
                "--gpus",
                "256",
                "--engine-tp",
                "32",
                "--train-pp",
                "16",
                "--prompts",
                "32",
                "--samples",
                "16",
                "--prompt-tokens",
                "150",
                "--max-response",
                "1386",
            ],
            "84.1 GiB per training GPU in tp1 pp16 ep16 over 256 x h100 (79.6 GiB): --engine-tp 64 "
            "--train-tp 1 --train-pp 1 fits, or --offload",
        ),
        # vLLM splits Qwen2.5-7B's 4 KV heads over 2 or 4 GPUs, or copies them whole onto 8
        (
            ["simulate", "qwen2.5-7b", "--gpus", "6", "--engine-tp", "7"],
            "divide --gpus 6; use --engine-tp 1 or 2",
        ),
        (["simulate", "qwen2.5-7b", "--gpus", "7", "--engine-tp", "7"], "4 KV heads or be a mul"),
        (["simulate", "qwen2.5-0.5b", "--extra-forwards", "9"], "--extra-forwards 9: must be 0..8"),
        # nothing fits: the trainer fits 2 GPUs with full recompute (77.6 GiB) but the engine's
        # cache does not, and --offload would; on 1 GPU neither change fits, so none is named;
        # shorter sequences are named only where the shortest, 2 tokens, would fit: not on 2
        # GPUs (the states beside the engine leave no cache at 2 tokens either)
        (
            ["plan", "llama3.1-8b", "--gpus", "2", "--recompute", "full"],
            "the closest's trainer fits (77.6 GiB) but its engines' KV cache cannot hold one "
            "sequence beside their weights (colocated sync | train dp1 tp2 pp1 zero3 | engine "
            "tp2): it fits 3 GPUs, or use --offload on these",
        ),
        (
            ["plan", "llama3.1-8b", "--gpus", "1"],
            "the closest needs 160.9 GiB a training GPU (colocated sync | train dp1 tp1 pp1 "
            "zero3 | engine tp1): it fits 3 GPUs",
        ),
        # tp 4 on 6 GPUs leaves Ulysses no degree: the hint says what to change instead
        (
            ["plan", "qwen2.5-7b", "--gpus", "6", "--tp", "4", "--sp", "3"],
            "whole heads); no --sp fits --tp 4 on 6 GPUs: change --tp or --gpus",
        ),
        # colocated, 8-way everything: only --offload leaves the engine's cache room
        (
            ["simulate", "qwen2.5-32b", "--train-tp", "8", "--engine-tp", "8"],
            "has no room for one sequence's KV cache: --offload fits, or give the engines GPUs",
        ),
        (["simulate", "qwen2.5-7b", "--engine-tp", "8"], "28 heads; use --engine-tp 1 or 2 or 4"),
        (
            ["plan", "qwen2.5-1.5b", "--roles", "policy", "--reward-model", "llama3.1-8b"],
            "leave out: add it, e.g. --roles policy,reward",
        ),
        # 3,000,512 tokens a sequence on one GPU: the lengths are what to lower
        (
            ["plan", "qwen2.5-0.5b", "--gpus", "1", "--max-response", "3000000"],
            "16,384 GPUs either; or lower --max-response or --prompt-tokens",
        ),
        # 4,096 optimizer steps on 1 sample; a staleness rule without asynchrony
        (
            ["simulate", "qwen2.5-0.5b", "--prompts", "1", "--samples", "1", "--minibatches", "2"],
            "--minibatches 2: more optimizer steps than the step's 1 samples",
        ),
        (["simulate", "qwen2.5-0.5b", "--drop-stale"], "--drop-stale applies to --mode async"),
        (
            [
                "simulate",
                "llama3.1-8b",
                "--minibatches",
                "3",
                "--updates-per-sync",
                "2",
                "--rollout-gpus",
                "4",
            ],
            "--minibatches 3 optimizer steps a step do not split evenly",
        ),
        # Llama 3.1 70B's 131.4 GiB of bf16 weights leave one H100 no cache: TP 2 holds it;
        # DeepSeek-V3's 1,250 GiB need TP 32, more GPUs than 8; no engine holds 10^9 tokens
        (["simulate", "llama3.1-70b"], "): use --engine-tp 2 or a GPU with more memory"),
        (["simulate", "deepseek-v3"], "use --engine-tp 32 on a multiple of 32 engine GPUs"),
        (
            ["simulate", "qwen2.5-0.5b", "--max-response", "1000000000"],
            "no engine of this GPU holds it, whatever its --engine-tp: lower --max-response",
        ),
        # a name over 255 bytes is refused by the file system: one line, not a traceback
        (["simulate", "/tmp/" + "d" * 300], "...: File name too long"),
        (["simulate", "qwen2.5-0.5b", "--lengths-from", "/tmp/" + "d" * 300], "File name too"),
        (["plan", "qwen2.5-0.5b", "--plot", "/tmp/" + "d" * 300 + ".png"], "File name too long"),
        (["plan", "qwen2.5-0.5b", "--minibatches", "0"], "--minibatches 0: must be 1..4,096"),
        (["simulate", "qwen2.5-0.5b", "--length-sigma", "nan"], "--length-sigma nan: must be 0"),
        (["simulate", "qwen2.5-0.5b", "--oversample", "-0.5"], "--oversample -0.5: must be 0..4"),
        (["simulate", "qwen2.5-0.5b", "--reward-seconds", "1e9"], "--reward-seconds 1000000000.0"),
        (["simulate", "qwen2.5-0.5b", "--spec-accept", "0.8"], "add --spec-tokens K"),
        (
            ["simulate", "qwen2.5-0.5b", "--spec-tokens", "2", "--spec-accept", "1.2"],
            "--spec-accept 1.2 must be in 0..1",
        ),
        (
            ["simulate", "qwen2.5-0.5b", "--spec-tokens", "17", "--spec-accept", "0.5"],
            "--spec-tokens 17 must be in 0..16",
        ),
        (["plan", "qwen2.5-0.5b", "--sp", "4"], "sequence parallel 4 does not divide the 14"),
        (["plan", "qwen2.5-0.5b", "--sp", "4"], "use --sp 1 or 2"),
        (["plan", "qwen2.5-0.5b", "--sp", "0"], "--sp 0: must be 1..1,024"),
        (["plan", "qwen2.5-0.5b", "--gpus", "8", "--sp", "7"], "--sp 7 takes the trainer's GPUs 7"),
        (["plan", "qwen2.5-7b", "--micro-batch", "0"], "--micro-batch 0: must be 1..4,096"),
        (["plan", "qwen2.5-7b", "--roles", "policy,policy,engine"], "'policy' given twice"),
        (["plan", "qwen2.5-7b", "--roles", "actor"], "'actor' is not a role; give each of"),
        (["plan", "qwen2.5-7b", "--roles", "policy,,engine"], "an empty role; give each of"),
        (["plan", "qwen2.5-7b", "--roles", "engine"], "trains a policy; give one"),
        (["simulate", "qwen2.5-7b", "--roles", "policy"], "on an engine's samples; give both"),
        (["plan", "qwen2.5-7b", "--plot", "no_such_folder/m.png"], "does not exist"),
        (["plan", "qwen2.5-7b", "--plot", "m.txt"], "ending in .png"),
        # a file where the folder should be is named as one
        (["plan", "qwen2.5-7b", "--plot", "README.md/m.png"], "folder README.md is a file, not"),
        # a folder nothing can be written in is refused before the work, not after it
        (["plan", "qwen2.5-7b", "--plot", "/proc/m.png"], "--plot /proc/m.png: cannot write in /p"),
        # the layouts the planner tries, named where none fits (sp 7 or pp 28 might)
        (
            ["plan", "qwen2.5-7b", "--prompt-tokens", "10000000"],
            "no placement with tp and sp of 1, 2, 4 or 8, pp of 1, 2, 4, 8 or 16 (--tp, --pp and "
            "--sp try others) fits up to 16,384 GPUs either",
        ),
        # a layout no placement's training GPUs take (2 colocated, 1 in a 1:1 split): the fewest
        # GPUs that fit, not merely the next multiple (4 GPUs need 329.9 GiB a GPU, 20 still
        # 93.3 GiB)
        (
            ["plan", "llama3.1-70b", "--gpus", "2", "--tp", "4"],
            "which no placement's training GPUs on --gpus 2 (2 and 1) take: use --gpus 24",
        ),
        # a degree the model cannot take is named before the GPU count
        (["plan", "llama3.1-70b", "--gpus", "2", "--tp", "4", "--ep", "4"], "has no experts"),
        (["simulate", "qwen2.5-7b", "--steps", "4", "--average-steps", "1-²"], "'1-²' is not"),
        (["simulate", "qwen2.5-0.5b", "--prompt-tokens", "0"], "--prompt-tokens 0: must be at"),
        # "it fits N GPUs" with a layout given: 10 GPUs fit --tp 4 as a 2:8 split, whose 8
        # training GPUs take it (test_a_layout_fits_a_split_whose_training_gpus_take_it), and
        # --tp 2 --ep 4 there too (8 training GPUs: 4 data-parallel ranks)
        (
            ["plan", "qwen3-30b-a3b", "--tp", "4", "--gpus", "4"],
            "ep1 zero3 | engine tp4): it fits 10 GPUs",
        ),
        (["plan", "qwen3-30b-a3b", "--tp", "2", "--ep", "4", "--gpus", "8"], "it fits 10 GPUs"),
        # a layout of 8 x 16 x 8 = 1,024 GPUs: its next multiple is the cap, not beyond it
        (
            [
                "plan",
                "deepseek-v3",
                "--tp",
                "8",
                "--pp",
                "16",
                "--sp",
                "8",
                "--gpus",
                "100",
                "--max-response",
                "485000",
            ],
            "(100, 75, 50 and 25) take, and no placement fits up to 16,384 GPUs either",
        ),
        (
            ["plan", "qwen2.5-7b", "--micro-batch", "64", "--tp", "4", "--pp", "2"],
            "no placement with sp of 1, 2, 4 or 8 (--sp tries others) fits up to 16,384",
        ),
        (
            ["simulate", "qwen2.5-7b", "--steps", "9", "--average-steps", "1-" + "1" * 5000],
            "'1-" + "1" * 38 + "...' is not FIRST-LAST",
        ),
        (["simulate", "qwen2.5-0.5b", "--max-response", "0"], "--max-response 0: must be at"),
        # 14 heads: sp 1, 2, 7 or 14 at tp 1, of which 1 and 2 divide the 8 training GPUs
        (["simulate", "qwen2.5-0.5b", "--train-sp", "0"], "--train-pp 1: --train-sp 1 or 2"),
        (
            ["plan", "qwen2.5-1.5b", "--roles", "policy,reward,engine", "--reward-model", ""],
            "--reward-model: model '': not a named shape",
        ),
        # expert parallel: a degree that divides the 128 experts, on 8 GPUs at most 8 (none of
        # them fits Qwen3-30B-A3B on 8 H100s: every divisor named)
        (["plan", "qwen3-30b-a3b", "--ep", "3"], "use --ep 1 or 2 or 4 or 8"),
        (["plan", "qwen2.5-7b", "--train-ep", "2"], "has no experts; leave --train-ep out"),
        # --average-steps averages steps --steps simulates: 5-9 needs 9 of them at least
        (["simulate", "qwen2.5-7b", "--average-steps", "5-9"], "give --steps 9..64"),
        (["simulate", "qwen2.5-7b", "--steps", "8", "--average-steps", "5-9"], "--steps 9..64"),
        (["simulate", "qwen2.5-7b", "--average-steps", "2-65"], "2-65: steps 1..64 at most"),
        (["simulate", "qwen2.5-7b", "--average-steps", "9-5"], "'9-5' is not FIRST-LAST, as 5-9"),
        (["simulate", "qwen2.5-7b", "--average-steps", "0-3"], "'0-3' is not FIRST-LAST"),
        (["simulate", "qwen2.5-7b", "--average-steps", "5"], "'5' is not FIRST-LAST"),
        # DeepSeek-V3 in 16 pipeline stages on 256 GPUs: of the degrees that divide its 256
        # experts, the placements that fit (the 128:128 split's 8 data-parallel ranks) take 8 at
        # most, not the 16 ranks of the colocated layout, which does not fit, nor 32..256
        (
            ["plan", "deepseek-v3", "--gpus", "256", "--pp", "16", "--ep", "3", "--offload"],
            "--ep 3 must divide deepseek-v3's 256 experts: use --ep 1 or 2 or 4 or 8",
        ),
        # with --tp 8 the data-parallel ranks 8 divides are multiples of 64 GPUs
        (
            ["plan", "qwen3-30b-a3b", "--gpus", "12", "--tp", "8", "--ep", "8"],
            "--tp 8 takes the trainer's GPUs 8 at a time, which no placement's training GPUs on "
            "--gpus 12 (12, 9, 6 and 3) take: with --ep 8, use --gpus 64",
        ),
        # 24 GPUs split 6:18, 12:12 and 18:6 (or all 24 colocated): no 16 data-parallel ranks;
        # ep 8 divides the colocated 24
        (
            ["plan", "qwen3-30b-a3b", "--gpus", "24", "--ep", "16"],
            "tokens per sequence and --ep 16 does not fit 24 x h100 (79.6 GiB) in any placement; "
            "no trainer layout on 24 GPUs has data-parallel ranks that --ep 16 divides: it fits "
            "32 GPUs, or use --ep 8 on these",
        ),
        # beyond 1,024 GPUs the count is searched in steps of 1,024, then node by node: tp 4 x
        # pp 3 takes 12 GPUs a rank, and 128 ranks' expert groups need 12 x 128 = 1,536 GPUs;
        # on these 1,032 GPUs, 86 = 2 x 43 ranks, of the 128 experts' divisors 1 and 2 divide it
        (
            ["plan", "qwen3-30b-a3b", "--gpus", "1032", "--tp", "4", "--pp", "3", "--ep", "128"],
            "divides: it fits 1,536 GPUs, or use --ep 2 on these",
        ),
        # qwen2.5-0.5b is 896 wide: a rank-4,096 pair on a 896 x 896 matrix holds 4,096 x 2 x
        # 896 = 7.3M parameters, 9.1x the matrix's 0.8M
        (
            ["simulate", "qwen2.5-0.5b", "--lora-rank", "4096"],
            "--lora-rank 4096: more than qwen2.5-0.5b's hidden size, 896; its adapters",
        ),
        # 28 heads on 28 GPUs: 7, 14 and 28 divide both, as well as 4 (the last four named)
        (
            ["plan", "qwen2.5-7b", "--gpus", "28", "--tp", "3"],
            "does not divide the 28 attention heads of qwen2.5-7b; use --tp 4 or 7 or 14 or 28",
        ),
        # Python's int() and float() take 8_0 as 80 and other scripts' digits: not here
        (["simulate", "qwen2.5-0.5b", "--gpus", "8_0"], "--gpus: invalid int value: '8_0'"),
        (["plan", "qwen2.5-0.5b", "--gpus", "\uff10\uff18"], "--gpus: invalid int value"),
        (["simulate", "qwen2.5-0.5b", "--mean-response", "1_000"], "invalid float value: '1_000'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    try:
        code = main(argv)
    except SystemExit as stopped:  # argparse's own refusals (a value that is no integer)
        code = stopped.code
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("treadle: error: ") and says in line, line


QWEN_05B_CONFIG = {"num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
                   "num_hidden_layers": 24, "intermediate_size": 4864, "vocab_size": 151936,
                   "tie_word_embeddings": True}  # fmt: skip


def test_a_layout_fits_a_split_whose_training_gpus_take_it(capsys):
    # --tp 4 on 10 GPUs: the colocated 10 and the 5:5 and 8:2 splits' training GPUs do not
    # take it, the 2:8 split's 8 do; plan recommends that placement alone
    assert main(["plan", "qwen3-30b-a3b", "--tp", "4", "--gpus", "10", "--steps", "2",
                 "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["kind"], row["rollout_gpus"], row["train_gpus"]) == ("disaggregated", 2, 8)
    assert "tp4" in row["placement"]


def test_a_folder_named_like_a_shape_is_read_not_shadowed(tmp_path, monkeypatch):
    # as transformers' from_pretrained: ./qwen2.5-7b/config.json (here a 0.5B's) is the model
    from treadle.scale.shapes import NAMED, resolve

    (tmp_path / "qwen2.5-7b").mkdir()
    (tmp_path / "qwen2.5-7b" / "config.json").write_text(json.dumps(QWEN_05B_CONFIG))
    monkeypatch.chdir(tmp_path)
    folder = resolve("qwen2.5-7b")  # 24 layers of 896, not the 7B's 28 of 3,584
    assert (folder.layers, folder.hidden) == (24, 896) != (NAMED["qwen2.5-7b"].layers, 3584)
    (tmp_path / "qwen2.5-7b" / "config.json").unlink()  # a folder without one: the name
    assert resolve("qwen2.5-7b") is NAMED["qwen2.5-7b"]


def test_a_model_folders_odd_name_is_one_line_and_drawn_as_written(tmp_path, capsys):
    # a line break in the name stays inside the one line; a $ is no formula in the plot title
    for name in ("nl\nmodel", "m$\\frac$"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(QWEN_05B_CONFIG))
    assert main(["plan", str(tmp_path / "nl\nmodel"), "--gpus", "2", "--tp", "3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "nl\\nmodel; use --tp 1 or 2" in line
    plot = tmp_path / "m.png"
    assert main(["plan", str(tmp_path / "m$\\frac$"), "--gpus", "2", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000


def test_a_value_pasted_whole_is_cut_in_the_one_line(capsys):
    # 100,000 characters given to --roles, which its refusal quotes twice: each quote is cut to
    # its first 160 and last 60 characters around an ellipsis, the fix still on the line
    value = "r" * 50_000 + "s" * 50_000
    assert main(["simulate", "qwen2.5-0.5b", "--roles", value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.count("r" * 158 + "…" + "s" * 58) == 2 and len(line) < 800
    assert line.endswith("comma-separated (e.g. policy,reference,engine)")
    # argparse's own refusal, and a value of many 200-character words: still a short line
    for argv in (["--gpus", "a" * 100_000], ["--roles", " ".join(["x" * 200] * 500)]):
        with pytest.raises(SystemExit) if argv[0] == "--gpus" else contextlib.nullcontext():
            assert main(["simulate", "qwen2.5-0.5b", *argv]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert len(line) < 1300 and line.endswith(
            ("lists the options)", "policy,reference,engine)")
        )


TWO_LAYER_MOE = {"num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 2,
                 "intermediate_size": 128, "vocab_size": 100, "num_experts": 8,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 64}  # fmt: skip
BAD_MOE_LAYERS = (
    ({"mlp_only_layers": [2]}, "mlp_only_layers is [2]; a list of layer indices 0..1"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers is '0'; a list"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0; a positive integer"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace is -1; an integer of 0 or more"),
    # hidden_size 4,096 / 8,192 heads: a head_dim of 0, which no key of the file says
    ({"num_attention_heads": 8192}, "4096 / num_attention_heads 8192 gives a head_dim of 0; give"),
    (
        {"shared_expert_intermediate_size": "64"},
        "shared_expert_intermediate_size is '64'; an integer of 0 or more",
    ),
    ({"n_shared_experts": -1}, "n_shared_experts is -1; an integer of 0 or more"),
    ({"num_experts": "8"}, "num_experts is '8'; a positive integer"),
    ({"kv_lora_rank": "128"}, "kv_lora_rank is '128'; an integer of 0 or more"),
    ({"kv_lora_rank": 32, "q_lora_rank": "16"}, "q_lora_rank is '16'; an integer of 0 or more"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than its 8 experts"),
    ({"hidden_size": 10**400}, "hidden_size is a huge number; a positive integer up to"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000; a positive integer up to"),
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0; a positive integer"),
    ({"num_attention_heads": None}, "num_attention_heads is null; a positive integer"),  # JSON's
    ({"head_dim": False}, "head_dim is false; a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false'; true or false"),
    ({"attention_bias": "no"}, "attention_bias is 'no'; true or false"),
)
"""Which layers hold experts, given badly (the layers are 0 and 1)."""


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ([1, 2], "holds a list, not an object"),
        (
            {
                "num_attention_heads": 0,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
            },
            "num_attention_heads is 0",
        ),
        (
            {
                "num_attention_heads": 32,
                "hidden_size": "4096",
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
            },
            "hidden_size is '4096'",
        ),
        (
            {
                "num_attention_heads": 32,
                "hidden_size": 4096,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
                "num_key_value_heads": 5,
            },
            "num_key_value_heads 5 does not divide",
        ),
        (
            {
                "num_attention_heads": 32,
                "hidden_size": 4096,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
                "num_experts": 8,
            },
            "8 experts but no 'num_experts_per_tok'",
        ),
        *(({**TWO_LAYER_MOE, **bad}, says) for bad, says in BAD_MOE_LAYERS),
    ],
)
def test_a_bad_config_json_is_one_line_exit_2(tmp_path, config, says, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line, line


def test_mixture_of_experts_configs_count_every_expert():
    from treadle.scale.shapes import from_hf_config

    # Mixtral 8x7B: 46.7B parameters, 12.9B active (2 of 8 experts of intermediate_size 14336)
    mixtral = from_hf_config({
        "num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 32,
        "intermediate_size": 14336, "vocab_size": 32000, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2}, "mixtral")  # fmt: skip
    assert mixtral.params() / 1e9 == pytest.approx(46.7, abs=0.1)
    assert mixtral.active_params() / 1e9 == pytest.approx(12.9, abs=0.2)
    # Qwen1.5-MoE-A2.7B: 14.3B parameters; its shared expert is 4 experts wide (5632 / 1408)
    qwen = from_hf_config({
        "num_attention_heads": 16, "hidden_size": 2048, "num_hidden_layers": 24,
        "intermediate_size": 5632, "vocab_size": 151936, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632}, "qwen-moe")  # fmt: skip
    assert qwen.shared_experts == 4
    assert qwen.params() / 1e9 == pytest.approx(14.3, abs=0.1)
    # experts every second layer, none in layer 1 (transformers' Qwen2-MoE: layer i has them
    # where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers): layers
    # 3, 5, ..., 23, 11 of 24. Each dense layer trades (60 + 4) x 3 x 2,048 x 1,408 expert and
    # 60 x 2,048 router parameters, 553,771,008, for a 3 x 2,048 x 5,632 = 34,603,008 MLP:
    # 13 x 519,168,000 = 6,749,184,000 fewer
    sparse = from_hf_config({
        "num_attention_heads": 16, "hidden_size": 2048, "num_hidden_layers": 24,
        "intermediate_size": 5632, "vocab_size": 151936, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 2,
        "mlp_only_layers": [1]}, "qwen-moe-sparse")  # fmt: skip
    assert (sparse.moe_layers, sparse.dense_layers) == (11, 13)
    assert qwen.params() - sparse.params() == 6_749_184_000
    assert qwen.active_params() - sparse.active_params() == 13 * (
        4 * 3 * 2048 * 1408 + 4 * 3 * 2048 * 1408 + 60 * 2048 - 3 * 2048 * 5632
    )


def test_plot_with_json_keeps_stdout_json_and_replaces_the_file_whole(tmp_path, capsys):
    path = tmp_path / "t.png"
    path.write_bytes(b"old")
    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8", "--json",
            "--plot", str(path)]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["step_s"] > 0 and f"plot: {path}" in err.replace("\n", "")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]  # no temporary left


def test_a_sigterm_while_the_plot_is_written_leaves_no_file(tmp_path, capsys, monkeypatch):
    # SIGTERM (what timeout, kill and schedulers send) lands while the plot's temporary file
    # is being written: one line, 128 + 15, and neither the plot nor its temporary file left
    import os
    import signal

    from treadle.scale import plots

    def timeline(result, path, title=""):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        os.kill(os.getpid(), signal.SIGTERM)  # its handler raises here, mid-write

    monkeypatch.setattr(plots, "timeline", timeline)
    before = signal.getsignal(signal.SIGTERM)
    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8", "--steps", "2",
            "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert main(argv) == 143
    assert capsys.readouterr().err == ("treadle: stopped by SIGTERM at once; nothing on disk is "
                                       "half-written\n")  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler put back


def test_the_timeline_is_titled_with_its_model_gpus_placement_and_mode(tmp_path, monkeypatch):
    # a plot seen apart from its command says which setting it draws (before: the step time
    # and staleness alone)
    from treadle.scale import plots

    titles = []

    def timeline(result, path, title=""):
        titles.append(title)
        path.write_bytes(b"\x89PNG")
        return path

    monkeypatch.setattr(plots, "timeline", timeline)
    plot = ["--plot", str(tmp_path / "t.png")]
    small = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8", "--steps", "2"]
    assert main([*small, "--rollout-gpus", "1", "--mode", "async", "--partial", *plot]) == 0
    assert main([*small, *plot]) == 0
    assert [t.split(": step ")[0] for t in titles] == [
        "qwen2.5-0.5b on 2 x h100, 1:1 engine:training GPUs, async eta 1",
        "qwen2.5-0.5b on 2 x h100, colocated, sync",
    ]


def test_a_plot_another_user_owns_in_a_sticky_folder_is_refused_first(tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    # /tmp's case: the folder lets anyone make files, but only a file's owner (or the
    # folder's) replace it, so the plot's rename would fail after the work; as seen by a user
    # who owns neither (geteuid: another uid than the one that made them)
    import os
    import stat

    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "t.png").write_bytes(b"theirs")
    folder.chmod(0o1777)
    assert folder.stat().st_mode & stat.S_ISVTX
    monkeypatch.setattr(os, "geteuid", lambda: folder.stat().st_uid + 1)
    assert main(["plan", "qwen2.5-0.5b", "--plot", str(folder / "t.png")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("it is another user's, in a sticky folder that only lets its owner "
                         "replace it; give another file name")  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == ["t.png"]  # no probe left


def test_disaggregated_steps_without_partial_end_with_their_sync():
    # one_step drains: every asked step ends (its sync included) and the trainer is busy < 1
    setup = Setup(gpu("h100"), 6, 2, mode="one_step")
    r = simulate(NAMED["qwen2.5-7b"], Workload(32, 8, 512, Lengths(20, 64)), setup, steps=2)
    assert r.step_s > 0 and 0 < r.trainer_busy <= 1 and 0 < r.engine_busy <= 1


@pytest.mark.parametrize("row", ROWS, ids=[row.setting for row in ROWS])
def test_every_published_row_runs_from_the_command_line(row):
    # `treadle simulate` with simulate_argv's arguments builds the row's own workload, setup
    # and roles (verl's DAPO runs no reference)
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _check, _roles, _setup, _workload, simulate_argv

    argv = simulate_argv(row.shape, row.work, row.setup, row.roles, row.steps, row.window)
    args = _parse(["simulate", *argv])
    _check(args)
    assert (args.steps, args.average_steps) == (row.steps, row.window)
    assert _roles(args.roles, "simulate") == row.roles
    assert _workload(args, row.roles) == row.work
    assert _setup(args, gpu(args.gpu)) == row.setup


@pytest.mark.parametrize(("accept", "per_step"), [(None, 1.0), ("0", 1.0), ("0.5", 1.5)])
def test_spec_accept_zero_is_a_setting_not_a_missing_one(accept, per_step):
    # --spec-accept 0 asks for a draft never accepted: each step verifies 2 tokens and keeps
    # (1 - 0^2) / (1 - 0) = 1; at 0.5, (1 - 0.5^2) / (1 - 0.5) = 1.5. Without --spec-tokens the
    # option is left out and a step adds its one token.
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _check, _setup

    spec = [] if accept is None else ["--spec-tokens", "1", "--spec-accept", accept]
    args = _parse(["simulate", "qwen2.5-0.5b", *spec])
    _check(args)
    setup = _setup(args, gpu(args.gpu))
    assert setup.spec_tokens == (0 if accept is None else 1)
    assert setup.tokens_per_step == pytest.approx(per_step)


@pytest.mark.parametrize(
    ("roles", "forwards"),
    [
        ("policy,engine", 1),
        ("policy,reference,engine", 2),
        ("policy,reference,critic,engine", 3),
        ("policy,reference,critic,reward,engine", 4),
    ],
)
def test_extra_forwards_default_to_what_the_roles_run(roles, forwards):
    # the old policy's logprobs, +1 for a reference, +1 for a critic's values, +1 for a reward
    # model's scores; a critic is trained too; an explicit --extra-forwards wins (verl's
    # use_rollout_log_probs: 0)
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _roles, _workload

    args = _parse(["simulate", "qwen2.5-0.5b", "--roles", roles])
    work = _workload(args, _roles(args.roles, "simulate"))
    assert (work.extra_forwards, work.critic) == (forwards, "critic" in roles)
    args = _parse(["simulate", "qwen2.5-0.5b", "--roles", roles, "--extra-forwards", "0"])
    assert _workload(args, _roles(args.roles, "simulate")).extra_forwards == 0


def test_a_plan_with_a_critic_trains_it_in_its_simulated_steps():
    # the same placements, the critic's update beside the policy's: train_flops grows from 4
    # forwards (the update's 3 and the old policy's) to 4 + 3 x 0.728 (Qwen2.5-0.5B's tied
    # vocabulary head is 27.2% of a forward at these lengths) = 1.546x; an H100 has no fixed
    # training overhead, and a dense model without tensor or sequence parallelism no
    # collectives: above 1.5x
    work = Workload(16, 4, 128, Lengths(200, 512))
    q = Question(NAMED["qwen2.5-0.5b"], gpu("h100"), 2, work, roles=("policy", "engine"))
    critic = replace(q, roles=("policy", "critic", "engine"))
    without = {p.label: p.result.train_s for p in plan(q, steps=2)}
    with_critic = {p.label: p.result.train_s for p in plan(critic, steps=2)}
    assert without.keys() == with_critic.keys()
    assert all(with_critic[k] > 1.5 * without[k] for k in without), (without, with_critic)


def test_a_setting_rounded_by_g_is_given_whole_on_the_command_line():
    # f"{3600.0001:g}" is "3600" and f"{1234.5678:g}" "1234.57": the command would simulate
    # another setting; the arguments parse back to the very same workload and setup
    from treadle.cli import _parse
    from treadle.jobs.scale_job import _roles, _setup, _workload, simulate_argv

    work = Workload(8, 4, 100, Lengths(1234.5678, 4096, 0.8), pack_tokens=1_000_000)
    setup = Setup(gpu("h100"), 8, 8, colocated=True, sync_seconds=3600.0001)
    argv = simulate_argv("qwen2.5-7b", work, setup)
    assert argv[argv.index("--sync-seconds") + 1] == "3600.0001"
    assert argv[argv.index("--mean-response") + 1] == "1234.5678"
    assert argv[argv.index("--pack-tokens") + 1] == "1000000"  # :g's 1e+06 is no integer
    args = _parse(["simulate", *argv])
    assert _workload(args, _roles(args.roles, "simulate")) == work
    assert _setup(args, gpu(args.gpu)) == setup


def test_plan_takes_simulates_names_for_the_trainer_layout():
    # a simulate command's --train-tp/--train-sp pasted into plan set its --tp/--sp
    from treadle.cli import _parse

    args = _parse(["plan", "qwen2.5-7b", "--train-tp", "2", "--train-sp", "4", "--train-pp", "2"])
    assert (args.tp, args.sp, args.pp) == (2, 4, 2)


def test_plan_pins_the_pipeline_stages_and_names_the_option_as_typed(capsys):
    # --pp 2 on 8 GPUs: every placement's trainer in 2 stages (the 4:4 split's 4 GPUs are
    # dp2 pp2), as --tp pins the tensor-parallel ranks
    assert main(["plan", "qwen2.5-7b", "--pp", "2", "--steps", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["train_layout"]["pp"] for r in rows} == {2}
    four = next(r for r in rows if r["train_gpus"] == 4)
    assert (four["train_layout"]["dp"], four["train_layout"]["tp"]) == (2, 1)
    # a bad value names the spelling given
    for option in ("--pp", "--train-pp", "--train-tp", "--sp"):
        assert main(["plan", "qwen2.5-7b", option, "0"]) == 2
        assert capsys.readouterr().err.strip() == f"treadle: error: {option} 0: must be 1..1,024"
    # 3 stages: the 2:6 split's 6 training GPUs take them, no other placement's; 5 stages, none
    assert main(["plan", "qwen2.5-7b", "--pp", "3", "--steps", "2", "--json"]) == 0
    assert [r["train_gpus"] for r in json.loads(capsys.readouterr().out)] == [6]
    assert main(["plan", "qwen2.5-7b", "--pp", "5"]) == 2
    assert "--pp 5 takes the trainer's GPUs 5 at a time" in capsys.readouterr().err
    # the layout refusals too: 28 heads take tp 1, 2, 4 (and 7, 14, 28 beyond the powers of
    # 2 offered); 28 heads / tp 1 take Ulysses 1, 2, 4, 7, 14, 28, of which 8 GPUs take 1, 2
    # and 4; 28 layers
    assert main(["plan", "qwen2.5-7b", "--train-tp", "3"]) == 2
    assert capsys.readouterr().err.endswith("; use --train-tp 1 or 2 or 4\n")
    assert main(["plan", "qwen2.5-7b", "--train-sp", "3"]) == 2
    assert capsys.readouterr().err.endswith("; use --train-sp 1 or 2 or 4\n")  # on 8 GPUs
    assert main(["plan", "qwen2.5-7b", "--gpus", "32", "--train-pp", "32"]) == 2
    assert capsys.readouterr().err.endswith("layers; use --train-pp 28 or fewer\n")
    assert main(["plan", "qwen2.5-7b", "--gpus", "3", "--train-tp", "4", "--pp", "1"]) == 2
    assert "error: --train-tp 4 x --pp 1 takes the trainer's GPUs 4" in capsys.readouterr().err
    # simulate's name a fix too: the degrees the heads (14) and the 8 training GPUs take
    assert main(["simulate", "qwen2.5-0.5b", "--train-tp", "4"]) == 2
    assert capsys.readouterr().err.endswith("; with --train-sp 1: --train-tp 1 or 2\n")
    assert main(["simulate", "qwen2.5-0.5b", "--train-pp", "3"]) == 2
    assert capsys.readouterr().err.endswith("; with --train-tp 1 --train-sp 1: --train-pp 1 or 2 "
                                            "or 4 or 8\n")  # fmt: skip


def test_plan_pins_the_expert_parallel_degree_and_simulates_it(capsys):
    # Qwen3-30B-A3B's 128 experts on 32 H100s: --ep 8 keeps the layouts whose data-parallel
    # ranks 8 divides (dp32, dp16, dp24; not the 24:8 split's dp4 sp2, which takes ep 4 by
    # default), each named with its ep, and simulates them at that degree: the colocated
    # placement's step is simulate's with --train-ep 8 (a token's 8 expert ranks within its
    # 8-GPU node, its all-to-alls over NVLink), shorter than at ep 32, simulate's default
    argv = ["plan", "qwen3-30b-a3b", "--gpus", "32", "--steps", "3", "--json"]
    assert main(argv) == 0
    default = {r["placement"]: r for r in json.loads(capsys.readouterr().out)}
    assert main([*argv, "--ep", "8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["train_layout"]["ep"] for r in rows} == {8}
    assert all(r["train_layout"]["dp"] % 8 == 0 for r in rows)
    assert "disaggregated 24:8 async | train dp4 tp1 pp1 sp2 ep4 zero3 | engine tp1" in default
    assert len(rows) == len(default) - 1
    colocated = next(r for r in rows if r["kind"] == "colocated")
    assert colocated["placement"] == "colocated sync | train dp32 tp1 pp1 ep8 zero3 | engine tp2"
    simulate = ["simulate", "qwen3-30b-a3b", "--gpus", "32", "--engine-tp", "2", "--steps", "3",
                "--json"]  # fmt: skip
    assert main([*simulate, "--train-ep", "8"]) == 0
    (at_8,) = json.loads(capsys.readouterr().out)
    assert colocated["simulated"]["step_s"] == pytest.approx(at_8["step_s"])
    assert main(simulate) == 0
    (at_32,) = json.loads(capsys.readouterr().out)
    assert at_8["step_s"] < at_32["step_s"]
    # without --ep, plan simulates each placement at the default degree and within a node
    # (the most up to 8 that divides the ranks and experts) and keeps the faster: the
    # colocated one at 8, as --ep 8 gives it
    assert default[colocated["placement"]]["simulated"] == colocated["simulated"]
    # with Ulysses 2 a node holds 8 / 2 = 4 data-parallel ranks: within a node is ep 4, not 8
    # (whose ranks span two nodes, half their all-to-alls over the NICs)
    assert main([*argv, "--max-response", "16384"]) == 0
    rows = json.loads(capsys.readouterr().out)
    colocated = next(r for r in rows if r["kind"] == "colocated")
    assert colocated["placement"] == (
        "colocated sync | train dp16 tp1 pp1 sp2 ep4 zero3 | engine tp2"
    )
    # the spelling typed names a bad degree; 1 on a dense model is no expert parallelism
    assert main(["plan", "qwen3-30b-a3b", "--train-ep", "0"]) == 2
    assert capsys.readouterr().err.strip() == "treadle: error: --train-ep 0: must be 1..16,384"
    assert main(["plan", "qwen2.5-7b", "--ep", "1", "--steps", "2", "--json"]) == 0
    assert {r["train_layout"]["ep"] for r in json.loads(capsys.readouterr().out)} == {1}


def test_a_moe_layout_names_its_expert_degree_1_too(capsys):
    # Qwen3-30B-A3B on 8 H200s at --ep 1: every rank holds every expert; the label says ep1,
    # since the default there is ep 8, and simulate's --train-ep 1 reproduces the step
    argv = ["plan", "qwen3-30b-a3b", "--gpu", "h200", "--gpus", "8", "--ep", "1", "--offload",
            "--steps", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = {r["placement"]: r for r in json.loads(capsys.readouterr().out)}
    colocated = rows["colocated sync | train dp8 tp1 pp1 ep1 zero3 | engine tp1"]
    simulate = ["simulate", "qwen3-30b-a3b", "--gpu", "h200", "--gpus", "8", "--offload",
                "--steps", "3", "--json"]  # fmt: skip
    assert main([*simulate, "--train-ep", "1"]) == 0
    (one,) = json.loads(capsys.readouterr().out)
    assert colocated["simulated"]["step_s"] == pytest.approx(one["step_s"])
    assert main(simulate) == 0  # the default, ep 8: a token's experts spread over the node
    (default,) = json.loads(capsys.readouterr().out)
    assert default["step_s"] != pytest.approx(one["step_s"])
    # a dense model's layouts name no ep; --ep's bound is the GPU count's, not --tp's 1,024
    assert main(["plan", "qwen2.5-7b", "--steps", "2", "--json"]) == 0
    assert all(" ep" not in r["placement"] for r in json.loads(capsys.readouterr().out))
    assert main(["plan", "qwen3-30b-a3b", "--ep", "16385"]) == 2
    assert capsys.readouterr().err.strip().endswith("--ep 16385: must be 1..16,384")
    # a hint is named only where it fits: a micro-batch of 1 does not bring --ep 256's 256
    # data-parallel ranks to 8 GPUs
    assert main(["plan", "deepseek-v3", "--ep", "256", "--micro-batch", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith("--ep 256 divides: it fits 512 GPUs")


def test_a_plan_without_an_engine_shows_training_alone(tmp_path, capsys):
    # --roles policy,critic: no engine to place, size or plot: one group of training GPUs
    argv = ["plan", "qwen2.5-7b", "--roles", "policy,critic", "--steps", "2"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["placement"] for r in rows] == ["training only | train dp8 tp1 pp1 zero3"]
    assert (rows[0]["engine_tp"], rows[0]["engine_peak_gib"]) == (None, None)
    assert (rows[0]["kind"], rows[0]["rollout_gpus"], rows[0]["train_gpus"]) == ("training", 0, 8)
    assert set(rows[0]["memory_gib"]) == {"policy", "critic"}
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.lstrip().startswith("1 "))
    assert line.split()[:4] == ["1", "training", "only", "dp8"] and " - " in line
    from treadle.scale.plan import Question, plan
    from treadle.scale.plots import memory_bars

    q = Question(NAMED["qwen2.5-7b"], gpu("h100"), 8, Workload(64, 8, 512, Lengths(2730, 8192)),
                 roles=("policy", "critic"))  # fmt: skip
    (only,) = plan(q, steps=2)
    assert [label for label, _ in memory_bars(only)] == ["trainer GPUs"]
    # the work is checked as with an engine: lengths below a token, a batch smaller than its
    # optimizer steps
    assert main([*argv, "--max-response", "-5000"]) == 2
    assert "--max-response -5000: must be at least 1 token" in capsys.readouterr().err
    assert main([*argv, "--prompts", "1", "--samples", "1", "--minibatches", "2"]) == 2
    assert "--minibatches 2: more optimizer steps" in capsys.readouterr().err


def test_piped_tables_are_not_cut(capsys, monkeypatch):
    # stdout is no terminal here: at rich's 80 columns the 16,384-GPU split's column titles
    # read "engi…", "step…"; 200 columns hold every one
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["plan", "llama3.1-8b", "--gpus", "16384", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "disagg 4096:12288 async" in out
    assert " #  placement e:t " in out and " busy e/t" in out


def test_a_plot_path_with_a_line_break_is_said_on_one_line(tmp_path, capsys):
    path = tmp_path / "a\nb.png"
    argv = ["simulate", "qwen2.5-0.5b", "--prompts", "4", "--samples", "2", "--steps", "2",
            "--plot", str(path)]  # fmt: skip
    assert main(argv) == 0 and path.exists()
    assert f"plot: {tmp_path}/a\\nb.png" in capsys.readouterr().err.splitlines()
