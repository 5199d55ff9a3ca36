"""Distillation: losses against hand computations, draft init by layer selection, reduced
vocabulary, export (incl. assistant_model in transformers), resume after an injected kill,
config validation, and the stage entry points end to end on a tiny model."""
import json
import math

import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.speculative.config import DistillConfig, DraftConfig
from pipeline.speculative.decode import autoregressive_generate, speculative_generate
from pipeline.speculative.distill import InjectedFault, distill, divergence, kd_loss, kd_loss_topk
from pipeline.speculative.draft_model import (DraftStudent, evenly_spaced_layers, fit_output_map, init_draft_from_layers,
                                              load_draft_vocab, select_vocab, tokenizer_differences)
from pipeline.speculative.evaluate import measure_speculative
from pipeline.speculative.stage_api import build_draft
from pipeline.speculative.targets import TargetStore, TrainingData

torch.set_num_threads(1)
V = 64


def tiny_llama(seed: int, layers: int = 4, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer(n_words: int = V - 3, shift: int = 0) -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i + shift}" for i in range(n_words)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def texts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    # a skewed word distribution, so frequency-based vocabularies are meaningful
    ids = (torch.rand(n, 60, generator=g) ** 3 * (V - 3)).long()
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


# ---------------------------------------------------------------- losses
P, Q = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]


def _logits(probs):
    return torch.tensor(probs).log()[None]


@pytest.mark.parametrize("kind,expected", [
    ("forward_kl", sum(p * math.log(p / q) for p, q in zip(P, Q))),
    ("reverse_kl", sum(q * math.log(q / p) for p, q in zip(P, Q))),
    ("tvd", 0.5 * sum(abs(p - q) for p, q in zip(P, Q))),
    ("jsd", sum(0.5 * p * math.log(p / ((p + q) / 2)) + 0.5 * q * math.log(q / ((p + q) / 2)) for p, q in zip(P, Q))),
])
def test_losses_match_hand_computation(kind, expected):
    assert kd_loss(_logits(Q), _logits(P), kind).item() == pytest.approx(expected, rel=1e-5)
    assert kd_loss(_logits(P), _logits(P), kind).item() == pytest.approx(0.0, abs=1e-6)


def test_top_k_coarsens_into_top_tokens_plus_rest():
    # k=1: buckets {token 0} and {tokens 1, 2}: p = (0.5, 0.5), q = (0.2, 0.8)
    expected = 0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)
    assert kd_loss(_logits(Q), _logits(P), "forward_kl", top_k=1).item() == pytest.approx(expected, rel=1e-5)
    assert kd_loss(_logits(Q), _logits(P), "tvd", top_k=1).item() == pytest.approx(0.3, rel=1e-5)


def test_the_teacher_is_conditioned_on_the_students_vocabulary():
    # the teacher's top-2 are full ids 0 and 1 (rest 0.2); the student has a row for token 0 only
    teacher_logp = torch.tensor([[math.log(0.5), math.log(0.3)]])
    student_ids = torch.tensor([[0, -1]])
    rest = torch.tensor([math.log(0.2)])
    student_logits = torch.tensor([[math.log(0.6), math.log(0.4)]])
    # buckets {0}, rest; token 1 is dropped and p renormalised: p = (0.5, 0.2) / 0.7, q = (0.6, 0.4)
    p0, pr = 0.5 / 0.7, 0.2 / 0.7
    expected = p0 * math.log(p0 / 0.6) + pr * math.log(pr / 0.4)
    got = kd_loss_topk(student_logits, teacher_logp, student_ids, rest, "forward_kl")
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_temperature_softens_both_sides_and_gradients_stay_finite():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 10), torch.randn(2, 5, 10)
    assert kd_loss(s, t, "jsd", temperature=2.0).item() == pytest.approx(kd_loss(s / 2, t / 2, "jsd").item(), rel=1e-5)
    for kind in ("forward_kl", "reverse_kl", "tvd", "jsd"):
        student = torch.randn(3, 8, requires_grad=True)
        ids = torch.tensor([[0, -1, 3], [-1, -1, -1], [5, 0, 7]])
        logp = torch.log_softmax(torch.randn(3, 3), -1) - 0.5
        kd_loss_topk(student, logp, ids, torch.full((3,), -1.0), kind).backward()
        assert torch.isfinite(student.grad).all(), kind
    with pytest.raises(ValueError, match="unknown distillation loss"):
        divergence(torch.zeros(1, 2), torch.zeros(1, 2), "kl")


# ---------------------------------------------------------------- draft init and vocabulary
def test_evenly_spaced_layers_include_first_and_last():
    assert evenly_spaced_layers(30, 4) == [0, 10, 19, 29]
    assert evenly_spaced_layers(30, 1) == [0] and evenly_spaced_layers(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="between 1 and"):
        evenly_spaced_layers(30, 31)


def test_layer_selection_copies_weights_and_keeps_a_working_kv_cache():
    verifier = tiny_llama(0, layers=4, tie=True)
    same = init_draft_from_layers(verifier, [0, 1, 2, 3])
    ids = torch.randint(0, V, (1, 9))
    assert torch.allclose(same(ids).logits, verifier(ids).logits, atol=1e-6)
    draft = init_draft_from_layers(verifier, [0, 3], untie_head=True)
    assert draft.config.num_hidden_layers == 2 and not draft.config.tie_word_embeddings
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, verifier.model.layers[3].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, verifier.lm_head.weight)
    spec, _ = speculative_generate(verifier, draft, ids, 12, gamma=3)  # cache layer indices renumbered
    assert spec.tolist() == autoregressive_generate(verifier, ids, 12)[0].tolist()
    with pytest.raises(ValueError, match="distinct indices"):
        init_draft_from_layers(verifier, [0, 4])


def test_vocabulary_subset_is_the_most_frequent_tokens():
    streams = [[5, 5, 5, 7, 7, 9], [7, 5, 3]]
    vocab = select_vocab(streams, 3, V, always=[2])
    assert vocab.tolist() == [2, 5, 7]
    assert select_vocab(streams, 2, V).tolist() == [5, 7]
    with pytest.raises(ValueError, match="vocab_size"):
        select_vocab(streams, V + 1, V)


def test_reduced_head_student_exports_a_standard_checkpoint(tmp_path):
    verifier = tiny_llama(0)
    draft = init_draft_from_layers(verifier, [0, 3], untie_head=True)
    vocab = torch.tensor([1, 2, 5, 9, 20, 33])
    student = DraftStudent(draft, vocab)
    ids = torch.randint(0, V, (2, 7))
    assert torch.allclose(student(ids), draft(ids).logits[..., vocab], atol=1e-6)
    with torch.no_grad():
        student.head.add_(1.0)  # as if trained
    student.export(tmp_path, tiny_tokenizer(), {"verifier": "baseline"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(load_draft_vocab(tmp_path), vocab)
    assert torch.allclose(loaded.lm_head.weight[vocab], student.head)
    assert torch.equal(loaded.lm_head.weight[3], verifier.lm_head.weight[3])  # outside the subset: untouched
    assert json.loads((tmp_path / "draft_manifest.json").read_text())["verifier"] == "baseline"
    with pytest.raises(ValueError, match="untied"):
        DraftStudent(tiny_llama(0, tie=True), vocab)


def test_tokenizer_differences_are_spelled_out():
    assert tokenizer_differences(tiny_tokenizer(), tiny_tokenizer()) == []
    diffs = tokenizer_differences(tiny_tokenizer(), tiny_tokenizer(shift=1))
    assert any("map to other ids" in d for d in diffs)
    assert any("vocabulary size" in d for d in tokenizer_differences(tiny_tokenizer(), tiny_tokenizer(n_words=40)))


# ---------------------------------------------------------------- training loop
def _run(tmp, fault=None, on_policy=0.5, steps=6, seed=0):
    teacher = tiny_llama(0)
    student = DraftStudent(init_draft_from_layers(teacher, [0, 3], untie_head=True), torch.arange(0, V, 2))
    cfg = DistillConfig(steps=steps, time_budget_s=None, batch_size=4, seq_len=16, lr=3e-3, warmup=1,
                        top_k=8, on_policy_fraction=on_policy, prompt_len=4, checkpoint_every=2)
    windows = torch.randint(0, V, (40, 16), generator=torch.Generator().manual_seed(1))
    data = TrainingData(teacher, windows, TargetStore(tmp / "targets"), batch_size=4, top_k=8, temperature=1.0,
                        on_policy_fraction=on_policy, prompt_len=4, seed=seed)
    metrics = distill(student, data, cfg, tmp / "work", seed, log=lambda *_: None, fault_at_step=fault,
                      progress=False, run_fingerprint="test")
    return student, metrics


def test_a_killed_run_resumes_to_the_same_weights(tmp_path):
    reference, _ = _run(tmp_path / "a")
    with pytest.raises(InjectedFault):
        _run(tmp_path / "b", fault=5)  # last checkpoint at step 4: step 4 is redone after resume
    resumed, metrics = _run(tmp_path / "b")
    assert metrics["resumed_from_step"] == 4 and metrics["steps"] == 6
    for (name, a), (_, b) in zip(reference.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


class _Planted:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def test_a_planted_pickle_in_the_resume_checkpoint_is_refused_and_never_runs(tmp_path):
    from pipeline.base.errors import StageError

    marker = tmp_path / "ran.txt"
    ckpt = tmp_path / "run" / "work" / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"fingerprint": "test", "state": {"step": 2}, "params": {}, "payload": _Planted(marker)}, ckpt)
    with pytest.raises(StageError, match=r"draft checkpoint .*checkpoint\.pt holds more than tensors and plain "
                                         r"values, so it was not loaded \(.*exec.*\); delete it"):
        _run(tmp_path / "run")
    assert not marker.exists(), "the planted code ran"
    torch.load(ckpt, weights_only=False)  # the plant is real: an unrestricted load runs it
    assert marker.read_text() == "code ran"


def test_distillation_lowers_the_loss(tmp_path):
    _, short = _run(tmp_path / "a", on_policy=0.0, steps=2)
    _, long = _run(tmp_path / "b", on_policy=0.0, steps=40)
    assert long["final_loss"] < 0.8 * short["final_loss"]
    assert long["trainable_params"] > 0 and long["tokens_seen"] == 40 * 4 * 16


# ---------------------------------------------------------------- config
def test_config_validation_messages():
    assert DraftConfig().init == "layers" and DraftConfig().num_layers is not None
    with pytest.raises(ValidationError, match="steps or time_budget_s"):
        DistillConfig(steps=None, time_budget_s=None)
    with pytest.raises(ValidationError, match="not both"):
        DraftConfig(num_layers=2, layers=[0, 1])
    with pytest.raises(ValidationError, match="needs source"):
        DraftConfig(init="model")
    with pytest.raises(ValidationError, match="prompt_len"):
        DistillConfig(on_policy_fraction=0.5, prompt_len=64, seq_len=32)
    with pytest.raises(ValidationError, match="Extra inputs"):
        DraftConfig(gama=4)
    assert DraftConfig(vocab_size="full").vocab_size is None and DistillConfig(steps=0, warmup=10).steps == 0
    with pytest.raises(ValidationError, match="dtype"):
        DraftConfig(dtype="float16")


# ---------------------------------------------------------------- stage entry points
def test_build_and_measure_end_to_end(tmp_path):
    verifier_dir = tmp_path / "verifier"
    tiny_llama(0).save_pretrained(verifier_dir)
    tiny_tokenizer().save_pretrained(verifier_dir)
    cfg = DraftConfig.model_validate({
        "num_layers": 2, "vocab_size": 32, "gamma": 3,
        "distill": {"steps": 4, "time_budget_s": None, "batch_size": 2, "seq_len": 16, "warmup": 1, "top_k": 8,
                    "on_policy_fraction": 0.5, "prompt_len": 4, "checkpoint_every": 2},
        "measure": {"num_prompts": 4, "prompt_len": 8, "new_tokens": 10, "temperatures": [0.0, 0.7], "warmup": 1}})
    metrics = build_draft(verifier_dir, cfg, texts(30), tmp_path / "draft", tmp_path / "work", seed=0,
                          log=lambda *_: None, progress=False)
    assert metrics["steps"] == 4 and metrics["layers"] == [0, 3] and metrics["draft_vocab_size"] == 32
    assert (tmp_path / "draft" / "draft_vocab.json").exists()
    report = measure_speculative(verifier_dir, tmp_path / "draft", texts(4, seed=9), cfg, seed=0,
                                 log=lambda *_: None, undistilled_dir=metrics["undistilled_dir"])
    greedy = report["distilled"]["t=0.0"]
    assert greedy["greedy_mismatches"] == [] and greedy["new_tokens"] == 4 * 10
    assert 0 <= greedy["alpha"] <= 1 and greedy["speedup"] > 0
    assert report["distilled"]["costs"]["c_d"] > 0 and "undistilled" in report
    assert greedy["hf_reference"]["identical_outputs"] == greedy["hf_reference"]["prompts"]


def test_pretrained_draft_without_distillation_in_bfloat16_stays_exact(tmp_path):
    """init = "model" from another checkpoint, steps = 0, dtype = bfloat16: saved in bf16, not trained,
    and greedy speculative output (ours and transformers' assisted generation) is still the verifier's."""
    verifier_dir, source_dir = tmp_path / "verifier", tmp_path / "small"
    tiny_llama(0).save_pretrained(verifier_dir)
    tiny_tokenizer().save_pretrained(verifier_dir)
    tiny_llama(5, layers=1).save_pretrained(source_dir)
    tiny_tokenizer().save_pretrained(source_dir)
    cfg = DraftConfig.model_validate({
        "init": "model", "source": str(source_dir), "init_head": "copy", "vocab_size": "full", "dtype": "bfloat16",
        "gamma": 3, "distill": {"steps": 0, "seq_len": 16},
        "measure": {"num_prompts": 3, "prompt_len": 8, "new_tokens": 12, "temperatures": [0.0], "warmup": 0}})
    metrics = build_draft(verifier_dir, cfg, texts(10), tmp_path / "draft", tmp_path / "work", seed=0,
                          log=lambda *_: None, progress=False)
    assert metrics["steps"] == 0 and metrics["layers"] is None and not (tmp_path / "work" / "checkpoint.pt").exists()
    assert not (tmp_path / "work" / "undistilled").exists()  # it would be the draft itself
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert saved.dtype == torch.bfloat16 and saved.config.num_hidden_layers == 1
    source = AutoModelForCausalLM.from_pretrained(source_dir)
    assert torch.equal(saved.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight.bfloat16())
    report = measure_speculative(verifier_dir, tmp_path / "draft", texts(3, seed=9), cfg, seed=0, log=lambda *_: None)
    greedy = report["distilled"]["t=0.0"]
    assert greedy["greedy_mismatches"] == [] and greedy["new_tokens"] == 3 * 12
    assert greedy["hf_reference"]["identical_outputs"] == greedy["hf_reference"]["prompts"]


def test_exported_draft_works_as_transformers_assistant_model(tmp_path):
    verifier = tiny_llama(0)
    student = DraftStudent(init_draft_from_layers(verifier, [0, 3], untie_head=True), torch.arange(0, V, 3))
    student.export(tmp_path)
    draft = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = verifier.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assisted = verifier.generate(ids, assistant_model=draft, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert assisted.tolist() == plain.tolist()


def test_tuned_lens_head_fits_the_verifier_better_than_the_copied_head():
    verifier = tiny_llama(0)
    windows = torch.randint(0, V, (16, 16), generator=torch.Generator().manual_seed(0))
    full = init_draft_from_layers(verifier, [0, 1, 2, 3], untie_head=True)
    assert fit_output_map(full, verifier, windows, precision="fp32") < 1e-3  # nothing to explain
    copied = init_draft_from_layers(verifier, [0], untie_head=True)
    lens = init_draft_from_layers(verifier, [0], untie_head=True)
    fit_output_map(lens, verifier, windows, precision="fp32")
    with torch.no_grad():
        teacher = verifier(windows).logits
        assert kd_loss(lens(windows).logits, teacher) < 0.9 * kd_loss(copied(windows).logits, teacher)
    with pytest.raises(ValueError, match="untied"):
        fit_output_map(tiny_llama(1, tie=True), verifier, windows)


# ---------------------------------------------------------------- draft stage and validate/draft/speculative units
def _fake_quantized(seed: int = 0) -> LlamaForCausalLM:
    """A stand-in for a quantized verifier: the baseline's weights rounded to a coarse grid."""
    model = tiny_llama(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p * 4).round() / 4)
    return model


def _saver(make_model):
    def fn(ctx):
        make_model().save_pretrained(ctx.out)
        tiny_tokenizer().save_pretrained(ctx.out)
        return {}
    return fn


STAGE_RECIPE = """
[run]
name = "tiny"
threads = 1

[model]
source = "config:tiny-llama"

[[quantize]]
name = "gptq-w4g32"
method = "gptq"
bits = 4
group_size = 32

[draft]
verifier = "gptq-w4g32"
num_layers = 2
vocab_size = 32
lens_tokens = 256

[draft.distill]
steps = 4
time_budget_s = 60
batch_size = 2
seq_len = 32
warmup = 1
checkpoint_every = 2

[draft.measure]
num_prompts = 2
prompt_len = 16
new_tokens = 8
warmup = 0
temperatures = [0.0, 0.7]
compare_hf_assisted = false
"""


def test_draft_stage_compares_a_draft_distilled_against_the_full_precision_model(tmp_path, monkeypatch):
    """compare_fp_distilled: the draft unit also distils against the baseline into draft/fp-distilled,
    validate measures it with the quantized verifier, the report labels its rows, export leaves it out."""
    import pipeline.data.calib
    from pipeline.results.render import render_report
    from pipeline.recipe import load_recipe
    from pipeline.app.runner import Runner
    from pipeline.base.unit import Unit
    from pipeline.stages import draft as draft_stage
    from pipeline.stages import export as export_stage
    from pipeline.stages import validate as validate_stage

    monkeypatch.setattr(pipeline.data.calib, "training_documents", lambda cfg: texts(30))
    monkeypatch.setattr(draft_stage, "training_documents", lambda cfg: texts(30))  # bound at its import
    monkeypatch.setattr(validate_stage, "held_out_prompts", lambda n, cfg, dataset=None: texts(n, seed=9))
    tiny = tmp_path / "recipe.toml"
    tiny.write_text(STAGE_RECIPE)
    recipe = load_recipe(tiny, ["draft.measure.compare_fp_distilled=true"])
    run_dir = tmp_path / "run"
    runner = Runner(run_dir, seed=0, device="cpu", versions={"x": "1"})
    runner.run_unit(Unit("load", {}, _saver(lambda: tiny_llama(0))))
    runner.run_unit(Unit("quantize/gptq-w4g32", {}, _saver(_fake_quantized)))
    unit = draft_stage.unit(recipe)
    off = draft_stage.unit(load_recipe(tiny))
    assert runner.inputs_hash(unit) != runner.inputs_hash(off), "the flag is part of the draft unit's config"

    runner.run_unit(unit)
    fp = run_dir / "draft" / "fp-distilled"
    assert (fp / "config.json").is_file() and (fp / "draft_vocab.json").is_file()
    fp_manifest = json.loads((fp / "draft_manifest.json").read_text())
    assert fp_manifest["verifier"] == "baseline" and fp_manifest["verifier_dir"] == "load"
    assert fp_manifest["layers"] == json.loads((run_dir / "draft" / "draft_manifest.json").read_text())["layers"]
    assert (run_dir / "draft" / "undistilled" / "config.json").is_file()
    assert runner.report.draft.distill.fp_distilled["steps"] == 4
    rerun = Runner(run_dir, seed=0, device="cpu", versions={"x": "1"})
    rerun.manifests = dict(runner.manifests)
    rerun.run_unit(unit)
    assert rerun.report.stages["draft"].status == "skipped", "an unchanged recipe reuses draft/fp-distilled"

    spec = next(u for u in validate_stage.units(recipe) if u.key == "validate/draft/speculative")
    runner.run_unit(spec)
    detail = runner.report.draft.speculative_detail
    assert {"distilled", "undistilled", "fp-distilled"} <= set(detail)
    # measured on the same prompts as the distilled draft (2 prompts x 8 new tokens), unlike the undistilled one
    assert detail["fp-distilled"]["t=0.0"]["new_tokens"] == detail["distilled"]["t=0.0"]["new_tokens"] == 2 * 8
    assert detail["fp-distilled"]["t=0.0"]["greedy_mismatches"] == []
    modes = runner.report.draft.speculative
    assert {"greedy", "t0.7", "undistilled greedy", "fp-distilled greedy", "fp-distilled t0.7"} <= set(modes)
    assert 0 <= modes["fp-distilled greedy"].alpha <= 1

    render_report(run_dir)
    md = (run_dir / "report.md").read_text().split("## Speculative decoding")[1].split("## Gates")[0]
    assert "| fp-distilled greedy (distilled against baseline, verified by gptq-w4g32) |" in md
    assert "fp-distilled rows: a draft with the same settings and budget distilled against the full-precision" in md

    exported = export_stage.checkpoint_files(run_dir / "draft")
    assert "config.json" in {p.name for p in exported}
    assert all(p.parent == run_dir / "draft" and p.is_file() for p in exported), "comparison drafts are not exported"


@pytest.mark.parametrize("model_type,extra,keep,dense", [
    ("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1}, [0, 2], [0]),  # a dense layer, a sparse one
    ("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1}, [2], []),
    ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, [1, 2], [0]),
])
def test_an_moe_draft_keeps_each_layers_dense_or_sparse_mlp(model_type, extra, keep, dense):
    """Layers picked from an MoE verifier keep their own MLP kind: the config's dense-layer fields are renumbered, so
    every copied weight has a place (init_draft_from_layers is strict) and the draft runs."""
    import json
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "arch" / f"{model_type}.json").read_text())
    d.update(vocab_size=64, **extra)
    torch.manual_seed(0)
    verifier = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).eval()
    draft = init_draft_from_layers(verifier, keep)
    kinds = ["experts" in dict(layer.mlp.named_children()) for layer in draft.model.layers]
    assert [i for i, sparse in enumerate(kinds) if not sparse] == dense
    assert torch.isfinite(draft(torch.randint(0, 64, (1, 8))).logits).all()
