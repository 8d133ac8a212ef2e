"""Hub ids read offline: models and datasets found in real cache layouts (ModelScope's, the
Hugging Face hub's, `datasets`' own) built in tmp dirs, with the cache variables set per test;
ms-swift's `#N` drawn from each dataset alone; a missing id refused before anything starts with
where it was looked for and how to download it; split_dataset_ratio deciding the held-out rows,
0 leaving evaluation off."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets.arrow_writer import ArrowWriter
from omegaconf import OmegaConf

from algorithms.config.swift_keys import translate
from algorithms.data.loading import DataConfig, check_data_files, load_task
from algorithms.records.trackers import read_metrics
from algorithms.sft import SFTConfig
from orchestration.config import ConfigError
from roles.models import build_model, load_tokenizer, resolve_config, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty ModelScope, Hugging Face hub and `datasets` caches, named by their variables."""
    roots = {name: tmp_path / name for name in ("ms", "hf", "hfd")}
    for name, var in (("ms", "MODELSCOPE_CACHE"), ("hf", "HF_HUB_CACHE"), ("hfd", "HF_DATASETS_CACHE")):
        roots[name].mkdir()
        monkeypatch.setenv(var, str(roots[name]))
    monkeypatch.delenv("USE_HF", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    return roots


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(build_model("tiny_qwen2"), load_tokenizer("tiny_qwen2"),
                           tmp_path_factory.mktemp("tiny") / "ckpt")


def numbered(n: int, start: int = 0) -> list[dict]:
    return [{"query": f"{i}+1", "response": f"#### {i + 1}"} for i in range(start, start + n)]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf_snapshot(root, kind: str, repo_id: str, revision: str = "abc"):
    """<root>/<kind>s--org--name/snapshots/<revision>, named by refs/main."""
    repo = root / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def prompts(examples) -> list[str]:
    return [e.prompt for e in examples]


# ------------------------------------------------------------------ models

def test_a_model_id_resolves_from_either_cache_modelscope_first(caches, checkpoint, monkeypatch, tmp_path):
    hf = hf_snapshot(caches["hf"], "model", "org/tiny")
    shutil.copytree(checkpoint, hf)
    cfg = resolve_config("org/tiny")
    assert cfg.path == str(hf) and cfg.name == "org/tiny"
    assert build_model("org/tiny").config.vocab_size == build_model("tiny_qwen2").config.vocab_size
    # ModelScope writes a '.' of the name as '___'; it is looked in first, as ms-swift does.
    ms = caches["ms"] / "models" / "org" / "tiny"
    shutil.copytree(checkpoint, ms)
    dotted = caches["ms"] / "models" / "org" / "tiny___5"
    shutil.copytree(checkpoint, dotted)
    assert resolve_config("org/tiny").path == str(ms) and resolve_config("org/tiny.5").path == str(dotted)
    monkeypatch.setenv("USE_HF", "1")
    assert resolve_config("org/tiny").path == str(hf)
    # A local folder of that name wins over every cache.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint, tmp_path / "org" / "tiny")
    assert resolve_config("org/tiny").path == str(tmp_path / "org" / "tiny")


def test_a_missing_model_id_names_where_it_was_looked_for_and_the_download(caches):
    with pytest.raises(ValueError) as err:
        resolve_config("org/absent")
    message = str(err.value)
    assert str(caches["ms"] / "models" / "org" / "absent") in message
    assert str(caches["hf"] / "models--org--absent") in message
    assert "`modelscope download --model org/absent`" in message and "`hf download org/absent`" in message
    # In a config_file the `model` key is refused before anything starts, named.
    with pytest.raises(ConfigError, match=r"model='org/absent': is no local folder, and the model org/absent is in "
                                          r"no local cache .*modelscope download --model org/absent"):
        translate({"model": "org/absent"}, "sft", OmegaConf.structured(SFTConfig))


# ------------------------------------------------------------------ datasets

def hf_hub_dataset(caches):
    """A dataset downloaded into the Hugging Face hub cache: parquet shards per split."""
    data = hf_snapshot(caches["hf"], "dataset", "org/rows") / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(numbered(12)), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(numbered(3, 100)), data / "test-00000-of-00001.parquet")
    (data.parent / "README.md").write_text("---\nlicense: mit\n---\n")


def modelscope_dataset(caches):
    """`modelscope download --dataset org/rows`: the repo's files, with ModelScope's metadata."""
    folder = caches["ms"] / "datasets" / "org" / "rows"
    write_jsonl(folder / "train.jsonl", numbered(12))
    write_jsonl(folder / "validation.jsonl", numbered(3, 100))
    (folder / "configuration.json").write_text('{"framework": "pytorch"}')
    (folder / ".msc").write_bytes(b"\x00")


def datasets_cache(caches):
    """A dataset once loaded with `datasets`: its arrow files under <org>___<name>/<subset>/<version>/<hash>."""
    folder = caches["hfd"] / "org___rows" / "default" / "0.0.0" / "f00d"
    folder.mkdir(parents=True)
    for split, rows in (("train", numbered(12)), ("test", numbered(3, 100))):
        with ArrowWriter(path=str(folder / f"rows-{split}.arrow")) as writer:
            for row in rows:
                writer.write(row)
            writer.finalize()
    (folder / "dataset_info.json").write_text("{}")


@pytest.mark.parametrize("layout", [hf_hub_dataset, modelscope_dataset, datasets_cache])
def test_a_dataset_id_reads_the_train_split_of_its_cached_copy(caches, layout):
    layout(caches)
    data = DataConfig(task="files", paths=["org/rows"], val_split=0.0)
    check_data_files(data)
    train, held, _ = load_task(data)
    assert prompts(train) == [f"{i}+1" for i in range(12)] and held == []  # the train split only, whole


def test_subsets_are_folders_of_a_dataset(caches):
    folder = caches["ms"] / "datasets" / "modelscope" / "gsm8k"
    write_jsonl(folder / "main" / "train.jsonl", numbered(4))
    write_jsonl(folder / "socratic" / "train.jsonl", numbered(2, 50))
    read = lambda entry: prompts(load_task(DataConfig(task="files", paths=[entry], val_split=0.0))[0])  # noqa: E731
    assert read("modelscope/gsm8k") == read("modelscope/gsm8k:main") == [f"{i}+1" for i in range(4)]
    assert read("modelscope/gsm8k:socratic") == ["50+1", "51+1"] and len(read("modelscope/gsm8k:all")) == 6
    with pytest.raises(ConfigError, match=r"^config key 'data.paths'='modelscope/gsm8k:nope' \(found at .*gsm8k\) "
                                          r"has no subset \['nope'\] \(its subsets: \['main', 'socratic'\]\)\. "
                                          r"Fix: "):
        check_data_files(DataConfig(task="files", paths=["modelscope/gsm8k:nope"]))
    shutil.move(folder / "main", folder / "first")
    with pytest.raises(ConfigError, match=r"several subsets \['first', 'socratic'\] and none is named\. Fix: "):
        check_data_files(DataConfig(task="files", paths=["modelscope/gsm8k"]))


def test_a_missing_dataset_id_is_refused_before_reading_with_the_download(caches):
    data = DataConfig(task="files", paths=["AI-ModelScope/alpaca-gpt4-data-en#2000"])
    with pytest.raises(ConfigError) as err:
        check_data_files(data)
    message = str(err.value)
    assert message.startswith("config key 'data.paths'='AI-ModelScope/alpaca-gpt4-data-en#2000' is no local path")
    assert "\n" not in message and ". Fix: " in message
    for place in (caches["ms"] / "datasets" / "AI-ModelScope" / "alpaca-gpt4-data-en",
                  caches["hf"] / "datasets--AI-ModelScope--alpaca-gpt4-data-en", caches["hfd"]):
        assert str(place) in message
    assert "`modelscope download --dataset AI-ModelScope/alpaca-gpt4-data-en`" in message
    assert "`hf download --repo-type dataset AI-ModelScope/alpaca-gpt4-data-en`" in message
    # hf:: looks in Hugging Face's caches alone.
    with pytest.raises(ConfigError) as err:
        check_data_files(DataConfig(task="files", paths=["hf::org/rows"]))
    assert str(caches["ms"]) not in str(err.value) and "modelscope download" not in str(err.value)


def test_a_local_path_wins_over_a_cached_id(caches, tmp_path, monkeypatch):
    modelscope_dataset(caches)
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "org" / "rows" / "train.jsonl", numbered(2, 70))
    train, _, _ = load_task(DataConfig(task="files", paths=["org/rows"], val_split=0.0))
    assert prompts(train) == ["70+1", "71+1"]


# ------------------------------------------------------------------ ms-swift's #N

def two_files(tmp_path):
    return write_jsonl(tmp_path / "a.jsonl", numbered(10)), write_jsonl(tmp_path / "b.jsonl", numbered(10, 100))


def test_hash_n_draws_n_rows_from_each_dataset_seeded(tmp_path):
    a, b = two_files(tmp_path)

    def drawn(seed):
        train, held, _ = load_task(DataConfig(task="files", paths=[f"{a}#3", f"{b}#15"], val_split=0.0, seed=seed))
        assert held == []
        return prompts(train)

    rows = drawn(0)
    from_a = [p for p in rows if int(p.split("+")[0]) < 100]
    from_b = [p for p in rows if int(p.split("+")[0]) >= 100]
    assert len(from_a) == 3 and len(set(from_a)) == 3  # fewer than its 10 rows: distinct ones
    # More than its 10 rows: every row once, then 5 more drawn (ms-swift's sample_dataset).
    assert len(from_b) == 15 and set(from_b) == {f"{i}+1" for i in range(100, 110)}
    assert drawn(0) == rows and drawn(1) != rows


def test_a_held_out_share_comes_from_each_dataset_before_its_draw(tmp_path):
    a, b = two_files(tmp_path)
    train, held, _ = load_task(DataConfig(task="files", paths=[f"{a}#4", f"{b}#30"], val_split=0.2, eval_size=64))
    # a: int(0.2 x 4) -> 1 held out, 3 trained; b: int(0.2 x 10) = 2 held out, 28 drawn from its other 8.
    assert len(held) == 3 and len(train) == 31
    assert not set(prompts(held)) & set(prompts(train))


def test_the_config_file_keeps_hash_n_on_each_dataset(tmp_path):
    a, b = two_files(tmp_path)
    _, out, _ = translate({"dataset": [f"{a}#3", str(b)]}, "sft", OmegaConf.structured(SFTConfig))
    assert out["data.paths"] == [f"{a}#3", str(b)] and "data.max_rows" not in out
    with pytest.raises(ConfigError, match=r"dataset=.*: '#0' after .* is no row count; write .*#N"):
        translate({"dataset": f"{a}#0"}, "sft", OmegaConf.structured(SFTConfig))


# ------------------------------------------------------------------ split_dataset_ratio

@pytest.mark.parametrize("file,want", [
    ({}, 0.0),  # ms-swift's default
    ({"split_dataset_ratio": 0}, 0.0),
    ({"split_dataset_ratio": 0.1}, 0.1),
    ({"split_dataset_ratio": 0.1, "val_dataset": "VAL"}, None),  # val_dataset's rows are the held-out ones
])
def test_split_dataset_ratio_decides_the_held_out_rows(tmp_path, file, want):
    a, b = two_files(tmp_path)
    file = {"dataset": str(a), **{k: str(b) if v == "VAL" else v for k, v in file.items()}}
    _, out, _ = translate(file, "sft", OmegaConf.structured(SFTConfig))
    assert out.get("data.val_split") == want


def test_split_dataset_ratio_0_trains_on_every_row_of_a_small_dataset(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", numbered(64))
    _, out, _ = translate({"dataset": str(path), "split_dataset_ratio": 0}, "sft", OmegaConf.structured(SFTConfig))
    train, held, _ = load_task(DataConfig(task="files", paths=out["data.paths"], val_split=out["data.val_split"]))
    assert len(train) == 64 and held == []  # before: all 64 held out (data.eval_size), and the run refused


def test_a_run_with_nothing_held_out_trains_and_skips_eval(tmp_path):
    """One tiny SFT run in-process: every step trains, no record has eval/accuracy."""
    from algorithms import sft
    from tests.driver_helpers import TINY, prepared

    path = write_jsonl(tmp_path / "rows.jsonl", numbered(12))
    _, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local", "run.steps=2",
                                          "run.save_final=false", "data.task=files", f"data.paths=['{path}#8']",
                                          "data.val_split=0", f"data.cache_dir={tmp_path / 'cache'}"])
    sft.validate(typed, plan)
    sft.run(typed, plan, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("eval/accuracy" not in r for r in records) and all(r["train/loss"] > 0 for r in records[1:])


def test_a_folder_without_data_files_is_refused_naming_it(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "README.md").write_text("no rows here\n")
    with pytest.raises(ConfigError, match=rf"^config key 'data.paths'='{folder}' holds no data file of a train "
                                          r"split\. Fix: "):
        check_data_files(DataConfig(task="files", paths=[str(folder)]))
