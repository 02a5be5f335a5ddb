"""LoRA fine-tuning of an mlx-lm model on N processes, offline, the way mlx-lm trains.

    pip install '.[lm]'                      # mlx-lm and tokenizers
    du-launch -n 2 --backend ring python examples/lora.py --iters 60
    du-launch -n 2 --backend ring python examples/lora.py --iters 90 --resume    # goes on from the last checkpoint

Nothing is downloaded: rank 0 writes a small data set (jsonl) and trains a BPE tokenizer on
it (the ``tokenizers`` package) into ``--data``, and the "pretrained" base is a tiny Llama
built with mlx-lm's own classes from a fixed seed, the same on every rank. Then:

- LoRA adapters (mlx-lm's ``linear_to_lora_layers``); the base is frozen, and only the
  adapters are synchronized, checkpointed and saved (``trainable_only``, ``du.save_adapters``);
- each rank reads and tokenizes only its own share of the data (``collate``), in batches of
  similar lengths (``lengths=``);
- mlx-lm's loss and compiled step, with the update inside ``mx.compile``, weighted by each
  rank's token count (``opt.update(model, grads, weight=ntoks)``): N ranks step like one
  process on the union of their tokens;
- the logged loss is the per-token mean over every rank (``du.weighted_mean``);
- validation visits every item exactly once (``batches(exactly_once=True)``);
- a checkpoint every ``--save-every`` steps with the data position; ``--resume`` continues;
- ``--fsdp``: every layer and then the whole model fully sharded (``du.fully_shard``): each rank
  holds 1/N of the frozen base and of the adapters; the step is not compiled, and each rank's loss
  is weighted by its share of the tokens before the backward pass, which reduces the gradients.

The adapters end in ``--out`` as mlx-lm writes them (``adapters.safetensors`` and
``adapter_config.json``): ``mlx_lm.tuner.utils.load_adapters(model, out)`` reads them.
"""

import argparse
import json
import random
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models import llama
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

import distributed_utils as du

LORA = {"rank": 8, "scale": 10.0, "dropout": 0.0}
NAMES = ["ada", "bob", "cyd", "dee", "eli", "fay", "gus", "hal", "ivy", "jon"]
THINGS = ["apples", "pears", "books", "coins", "shells", "stones"]


def write_data(folder: Path, train_items=800, valid_items=101, seed=0):
    """jsonl of short arithmetic stories of varied lengths, and a BPE tokenizer trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)

    def story():
        parts, total = [], 0
        for _ in range(rng.randint(1, 6)):
            name, count, thing = rng.choice(NAMES), rng.randint(1, 9), rng.choice(THINGS)
            parts.append(f"{name} has {count} {thing}")
            total += count
        return ", ".join(parts) + f". in all {total}."

    folder.mkdir(parents=True, exist_ok=True)
    texts = {"train": [story() for _ in range(train_items)], "valid": [story() for _ in range(valid_items)]}
    for split, lines in texts.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<pad>", "<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts["train"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


def read_items(path: Path) -> list:
    """The jsonl's items, each with its line number as ``id``: cheap (text only; the tokenizing
    happens per batch, on the rank that reads it)."""
    return [{"id": i, **json.loads(line)} for i, line in enumerate(path.read_text().splitlines())]


def collate_with(tokenizer, max_length=256):
    """A collate function for mlx-lm's loss: (tokens, [offset, length] per row, ids)."""
    eos = tokenizer.token_to_id("<eos>")

    def collate(items):
        rows = [tokenizer.encode(item["text"]).ids[: max_length - 1] + [eos] for item in items]
        width = max(len(r) for r in rows)
        tokens = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        lengths = mx.array([[0, len(r)] for r in rows])
        return mx.array(tokens), lengths, [item["id"] for item in items]

    return collate


def base_model(vocab_size, seed=0):
    """The "pretrained" base: a tiny Llama from mlx-lm's classes, the same on every rank."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=96,
        num_hidden_layers=2,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def with_lora(model, seed=1):
    """Freeze the base and add LoRA adapters to every layer (as ``mlx_lm lora`` does)."""
    model.freeze()
    mx.random.seed(seed)
    linear_to_lora_layers(model, len(model.layers), LORA)
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="lora-data", help="where the generated data and tokenizer live")
    p.add_argument("--out", default="lora-out", help="checkpoints and the final adapters")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="per rank (global: N times this)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --out")
    p.add_argument("--log-ids", action="store_true", help="rank 0 prints each step's global batch (item ids)")
    p.add_argument("--fsdp", action="store_true", help="shard the base and the adapters over the ranks")
    args = p.parse_args()

    backend = du.initialize()
    rank = du.local_rank(backend)
    data_dir, out = Path(args.data), Path(args.out)
    if rank == 0 and not (data_dir / "tokenizer.json").exists():
        write_data(data_dir)
    du.barrier(backend)  # the data exists for every rank (a shared filesystem, or one host)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    collate = collate_with(tokenizer)
    train_items, valid_items = read_items(data_dir / "train.jsonl"), read_items(data_dir / "valid.jsonl")
    train = du.DistributedDataContainer(
        backend, train_items, collate=collate, lengths=lambda item: len(item["text"])
    )
    valid = du.DistributedDataContainer(backend, valid_items, collate=collate)

    model = with_lora(base_model(tokenizer.get_vocab_size()))
    du.synchronize(backend, model, trainable_only=True)  # the adapters: root's; the base is the same
    if args.fsdp:  # each rank keeps 1/N of every layer, then of the rest (rank 0's values)
        for unit in [*model.layers, model]:
            du.fully_shard(backend, unit)
    opt = du.DistributedOptimizer(backend, optim.Adam(learning_rate=args.lr))
    opt.init(model.trainable_parameters())
    step_no = 0
    if args.resume:
        state = du.load_checkpoint(backend, out / "checkpoints", model=model, optimizer=opt, data=train)
        step_no = 0 if state is None else state["step"]
        if rank == 0:
            print(f"resumed at step {step_no}, epoch {train.epoch}", flush=True)

    loss_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens, lengths):
        (loss, ntoks), grads = loss_and_grad(model, tokens, lengths)
        opt.update(model, grads, weight=ntoks)  # the per-token mean over every rank's tokens
        return loss, ntoks

    def weighted_loss(model, tokens, lengths):  # (--fsdp: the gradients are averaged in the backward pass)
        loss, ntoks = default_loss(model, tokens, lengths)
        share = du.total_workers(backend) * ntoks / du.allreduce(backend, ntoks, "sum")
        return loss * share, (loss, ntoks)

    def fsdp_step(tokens, lengths):
        (_, (loss, ntoks)), grads = fsdp_loss_and_grad(model, tokens, lengths)
        opt.update(model, grads)
        return loss, ntoks

    if args.fsdp:
        fsdp_loss_and_grad, step = nn.value_and_grad(model, weighted_loss), fsdp_step

    model.train()
    while step_no < args.iters:
        for tokens, lengths, ids in train.batches(args.batch_size, shuffle=True, seed=0, epoch=train.epoch):
            with du.watch(f"train step {step_no + 1}"):  # its collectives run at this eval
                loss, ntoks = step(tokens, lengths)
                mx.eval(state, loss, ntoks)
            step_no += 1
            everyone = du.weighted_mean(backend, loss, ntoks)  # collective: every rank calls it
            if args.log_ids:
                batch = du.allgather(backend, ids)
                if rank == 0:
                    print(f"batch {step_no} ids {json.dumps([i for r in batch for i in r])}", flush=True)
            if rank == 0:
                print(f"step {step_no} loss {everyone!r}", flush=True)  # (every digit: bit for bit)
            if step_no % args.save_every == 0:
                du.save_checkpoint(
                    backend,
                    out / "checkpoints",
                    model=model,
                    optimizer=opt,
                    data=train,
                    step=step_no,
                    keep=2,
                    trainable_only=True,
                )
            if step_no == args.iters:
                break

    model.eval()
    total = count = 0.0
    for (tokens, lengths, _), mask in valid.batches(args.batch_size, exactly_once=True):
        lengths = lengths * mask.astype(lengths.dtype)[:, None]  # filler rows: no tokens
        loss, ntoks = default_loss(model, tokens, lengths)
        if ntoks.item():
            total, count = total + loss.item() * ntoks.item(), count + ntoks.item()
    valid_loss = du.weighted_mean(backend, total / count if count else 0.0, count)
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": LORA}
    du.save_adapters(backend, out / "adapters.safetensors", model, config=config)
    if rank == 0:
        print(f"validation loss {valid_loss:.6f} over every item once; adapters in {out}", flush=True)


if __name__ == "__main__":
    main()
