"""The examples, as the README runs them: 2 processes under du-launch, a few steps each."""

import importlib.util
import re
import sys
import types

import pytest
from launching import ROOT, launch

DIGITS = ["python", "examples/digits.py"]
EPOCH = re.compile(r"epoch +(\d+)  train loss ([\d.]+)  test loss ([\d.]+)  test accuracy ([\d.]+)")
FINAL = re.compile(r"\[rank 0\] final test loss ([\d.]+)  test accuracy ([\d.]+)")
CHECKSUM = re.compile(r"\[rank 0\] parameter checksum (\w+)")


def digits(*args, backend="mpi"):
    run = launch(2, backend, DIGITS + list(args), timeout=240)
    assert run.returncode == 0, run.stdout
    epochs = {int(m.group(1)): m.group(0) for m in EPOCH.finditer(run.stdout)}
    final = FINAL.search(run.stdout)
    checksum = CHECKSUM.search(run.stdout)
    assert final and checksum, run.stdout
    return run, epochs, float(final.group(2)), checksum.group(1)


def test_digits_trains_past_90_percent_and_resumes_where_it_stopped(tmp_path):
    """The README's main job (10 epochs by default), then the same run cut in two by a
    checkpoint: the resumed run prints the same epochs and ends with the same bits."""
    pytest.importorskip(
        "sklearn", reason="the digits example needs the examples extra: pip install '.[examples]'"
    )
    whole, epochs, accuracy, checksum = digits()
    assert sorted(epochs) == list(range(1, 11)), whole.stdout
    losses = [float(EPOCH.search(epochs[e]).group(2)) for e in sorted(epochs)]
    assert losses[-1] < losses[0] / 5, losses
    assert accuracy > 0.9, whole.stdout
    assert not re.search(r"\[rank 1\] .*(epoch|final|checksum)", whole.stdout), "only rank 0 logs"

    ckpt = tmp_path / "ckpt"
    first, first_epochs, _, _ = digits("--epochs", "4", "--checkpoint", str(ckpt), "--resume")
    assert "no checkpoint" in first.stdout and sorted(first_epochs) == [1, 2, 3, 4]
    assert (ckpt / "digits.safetensors").exists()
    second, second_epochs, resumed_accuracy, resumed_checksum = digits("--checkpoint", str(ckpt), "--resume")
    assert "resumed from" in second.stdout and "at epoch 5" in second.stdout, second.stdout
    assert sorted(second_epochs) == list(range(5, 11)), second.stdout
    for e in range(1, 11):  # the same losses and accuracies, printed to 4 digits
        assert (first_epochs | second_epochs)[e] == epochs[e], (e, first.stdout, second.stdout)
    assert (resumed_accuracy, resumed_checksum) == (accuracy, checksum), "bit-identical parameters"


def test_llama_trains_and_reports_throughput_and_memory_per_rank():
    run = launch(
        2,
        "mpi",
        ["python", "examples/llama_tinystories.py", "--steps", "2", "--block", "16", "--batch-size", "1"],
        timeout=240,
    )
    assert run.returncode == 0, run.stdout
    assert "Llama with 28.4M parameters" in run.stdout, run.stdout
    losses = [float(x) for x in re.findall(r"\[rank 0\] step +\d+  loss ([\d.]+)", run.stdout)]
    assert len(losses) == 2 and losses[-1] < losses[0], run.stdout
    for rank in (0, 1):  # gathered to rank 0, which prints a row per rank
        assert re.search(
            rf"\[rank 0\] rank {rank}: +\d+ tokens/s +[\d.]+ ms/step  peak memory +[\d.]+ MiB  peak RSS",
            run.stdout,
        )
    assert re.search(r"\[rank 0\] total: \d+ tokens/s on 2 ranks", run.stdout), run.stdout


def offline(monkeypatch):
    """The example sets these (setdefault); set here, they are undone after the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama_example():
    """examples/llama_tinystories.py as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("llama_example", ROOT / "examples" / "llama_tinystories.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_generated_stories_are_tinystories_style_and_made_when_read(llama_example):
    stories = llama_example.GeneratedStories(1000, seed=0)
    assert len(stories) == 1000 and "there was a little" in stories[7]["text"]
    assert stories[7] == llama_example.GeneratedStories(1000, seed=0)[7]  # the same on every rank
    assert stories[7] != stories[8]


def test_llama_collate_makes_rows_of_a_block_with_a_mask(llama_example):
    collate = llama_example.collate_with(lambda text: list(text.encode()), block=8)
    tokens, mask = collate([{"text": "abc"}, {"text": "a long story here"}])
    assert tokens.shape == mask.shape == (2, 9)
    assert tokens[0].tolist() == [97, 98, 99, llama_example.EOS] + [llama_example.EOS] * 5
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0, 0], [1] * 9]  # cut to block + 1


def test_llama_reads_tinystories_with_the_gpt2_tokenizer_when_they_are_cached(llama_example, monkeypatch):
    """The Hugging Face path, with stand-ins for the cached dataset and tokenizer."""
    offline(monkeypatch)
    calls = []

    class Tokenizer:
        eos_token_id = 50256

        @classmethod
        def from_pretrained(cls, name):
            calls.append(("tokenizer", name))
            return cls()

        def __call__(self, text):
            return {"input_ids": [len(word) for word in text.split()]}

    def load_dataset(name, split):
        calls.append(("dataset", name, split))
        return [{"text": "Once upon a time"}, {"text": "there was a cat"}]

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=Tokenizer))
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    stories, tokenize, source = llama_example.tinystories()
    assert calls == [("tokenizer", "gpt2"), ("dataset", "roneneldan/TinyStories", "train")]
    assert stories[1]["text"] == "there was a cat" and "TinyStories" in source
    assert tokenize("Once upon a time") == [4, 4, 1, 4]


def test_llama_falls_back_when_the_hub_is_unreachable(llama_example, monkeypatch):
    offline(monkeypatch)

    def load_dataset(name, split):
        raise ConnectionError("Couldn't reach the Hugging Face Hub (offline mode is enabled)")

    tokenizer = types.SimpleNamespace(from_pretrained=lambda name: None)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=tokenizer))
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    stories, tokenize, why = llama_example.tinystories()
    assert stories is None and tokenize is None and why.startswith("ConnectionError: Couldn't reach")


LORA = ROOT / "examples" / "lora.py"
LORA_STEP = re.compile(r"\[rank 0\] step (\d+) loss (\S+)")
LORA_BATCH = re.compile(r"\[rank 0\] batch (\d+) ids (\[.*\])")


def lora(backend, tmp_path, out, *args):
    run = launch(
        2,
        backend,
        ["python", str(LORA), "--data", str(tmp_path / "data"), "--out", str(tmp_path / out), *args],
        timeout=300,
    )
    assert run.returncode == 0, run.stdout
    return run, {int(s): float(x) for s, x in LORA_STEP.findall(run.stdout)}


def import_example(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["ring"])  # (the example's transport: tests/distributed covers each)
def test_lora_example_steps_like_mlx_lm_trainer_and_resumes_exactly(backend, tmp_path):
    """The LoRA example on 2 ranks against mlx-lm's own trainer (one process, fed the same
    global batches): the same per-token loss at every step. Then the run cut in two by a
    checkpoint gives the same losses after the cut."""
    pytest.importorskip("mlx_lm", reason="the LoRA example needs the lm extra: pip install '.[lm]'")
    import json

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from tokenizers import Tokenizer

    whole, losses = lora(backend, tmp_path, "whole", "--iters", "12", "--save-every", "6", "--log-ids")
    assert sorted(losses) == list(range(1, 13)), whole.stdout
    assert "validation loss" in whole.stdout and (tmp_path / "whole" / "adapters.safetensors").exists()
    batches = {int(s): json.loads(ids) for s, ids in LORA_BATCH.findall(whole.stdout)}

    ex = import_example(LORA)
    tokenizer = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json"))
    items = ex.read_items(tmp_path / "data" / "train.jsonl")
    collate = ex.collate_with(tokenizer)
    model = ex.with_lora(ex.base_model(tokenizer.get_vocab_size()))

    def same_batches(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        for s in sorted(batches):
            tokens, lengths, _ = collate([items[i] for i in batches[s]])
            yield tokens, lengths

    reported = {}

    class Losses:
        def on_train_loss_report(self, info):
            reported[info["iteration"]] = info["train_loss"]

        def on_val_loss_report(self, info):
            pass

    args = TrainingArgs(
        batch_size=16,
        iters=12,
        steps_per_report=1,
        steps_per_eval=10**9,
        steps_per_save=10**9,
        adapter_file=str(tmp_path / "mlx-lm-adapters.safetensors"),
        max_seq_length=256,
    )
    train(
        model,
        optim.Adam(learning_rate=2e-3),
        items,
        args=args,
        iterate_batches=same_batches,
        training_callback=Losses(),
    )
    for s in range(1, 13):
        assert abs(losses[s] - reported[s]) < 5e-4, (s, losses[s], reported[s])  # measured: 4e-5 at most

    from mlx_lm.tuner.utils import load_adapters  # the adapters as mlx-lm reads them

    adapted = load_adapters(ex.base_model(tokenizer.get_vocab_size()), str(tmp_path / "whole"))
    saved = mx.load(str(tmp_path / "whole" / "adapters.safetensors"))
    got = dict(tree_flatten(adapted.parameters()))
    assert len(saved) == 28 and all(
        mx.array_equal(saved[k], got[k]).item() for k in saved
    )  # 2 layers x 7 x (a, b)

    _, first = lora(backend, tmp_path, "cut", "--iters", "6", "--save-every", "6")
    second_run, second = lora(backend, tmp_path, "cut", "--iters", "12", "--save-every", "6", "--resume")
    assert "[rank 0] resumed at step 6" in second_run.stdout, second_run.stdout
    assert sorted(second) == list(range(7, 13))
    for s in range(1, 13):  # (printed with every digit: the same float, bit for bit)
        assert ({**first, **second})[s] == losses[s], (s, first, second, losses)
    cut = mx.load(str(tmp_path / "cut" / "adapters.safetensors"))
    assert all(mx.array_equal(cut[k], saved[k]).item() for k in saved)  # the adapters too


def test_lora_example_fully_sharded_steps_like_the_replicated_run(tmp_path):
    """--fsdp: every layer and the model fully sharded over 2 ranks (the frozen base too); the same
    losses and validation loss as the replicated run (to rounding: the backward pass is recomputed
    per layer and the loss weighted before it), and adapters that mlx-lm reads."""
    pytest.importorskip("mlx_lm", reason="the LoRA example needs the lm extra: pip install '.[lm]'")
    import mlx.core as mx

    replicated, losses = lora("ring", tmp_path, "replicated", "--iters", "8", "--save-every", "4")
    sharded, sharded_losses = lora("ring", tmp_path, "sharded", "--iters", "8", "--save-every", "4", "--fsdp")
    assert sorted(sharded_losses) == list(range(1, 9))
    for s in losses:
        assert abs(losses[s] - sharded_losses[s]) < 1e-4 * losses[s], (s, losses, sharded_losses)
    valid = [float(re.search(r"validation loss (\S+)", run.stdout).group(1)) for run in (replicated, sharded)]
    assert abs(valid[0] - valid[1]) < 1e-4 * valid[0], valid
    mine, theirs = (
        mx.load(str(tmp_path / out / "adapters.safetensors")) for out in ("sharded", "replicated")
    )
    assert mine.keys() == theirs.keys() and all(
        mx.allclose(mine[k], theirs[k], atol=1e-5).item() for k in mine
    )
