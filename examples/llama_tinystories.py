"""Train a small Llama language model data-parallel on TinyStories, and report throughput.

    du-launch -n 2 --backend mpi python examples/llama_tinystories.py            # 20 steps
    du-launch -n 2 --backend ring python examples/llama_tinystories.py --steps 5 --block 128

The model: 4 layers, 256 dims, 4 heads, SwiGLU MLP of 512, RoPE, RMSNorm, GPT-2's vocabulary
of 50257 (about 28M parameters, most of them in the embedding and the output layer).

The data: the Hugging Face dataset roneneldan/TinyStories with the GPT-2 tokenizer, when both
are already on this machine (`pip install datasets transformers` and their caches filled:
nothing is downloaded unless you set HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0). Otherwise
stories in the same style are generated from templates and tokenized by bytes (ids 0-255, and
50256 as GPT-2's end-of-text), so the example always runs; the model keeps its vocabulary.
Each rank reads and tokenizes only the stories of its own batches (``collate``): a story is
a row of --block + 1 tokens (cut, or padded with end-of-text), and the loss is the mean over
every rank's real tokens (``weight=``), so memory per rank does not grow with the ranks.

On a CPU this is slow at the full shape: each step's output layer alone is about 160 GFLOP
(batch 4 x 512 tokens x 256 x 50257, forward and backward); use --block 64 for a quick look.

Every rank reports its tokens/s, step time and peak memory; rank 0 gathers and prints them.
"""

import argparse
import itertools
import os
import random
import resource
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du

EOS = 50256  # GPT-2's <|endoftext|>


# --- the model ----------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dims, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(dims, dims, bias=False)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims, bias=False)
        self.o_proj = nn.Linear(dims, dims, bias=False)
        self.rope = nn.RoPE(dims // n_heads, base=10000)

    def __call__(self, x):
        B, L, D = x.shape
        q, k, v = (
            p(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = self.rope(q), self.rope(k)
        scale = (D // self.n_heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class SwiGLU(nn.Module):
    def __init__(self, dims, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dims, n_heads, mlp_dims):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dims)
        self.attention = Attention(dims, n_heads)
        self.mlp_norm = nn.RMSNorm(dims)
        self.mlp = SwiGLU(dims, mlp_dims)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=50257, dims=256, n_layers=4, n_heads=4, mlp_dims=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, dims)
        self.layers = [Block(dims, n_heads, mlp_dims) for _ in range(n_layers)]
        self.norm = nn.RMSNorm(dims)
        self.lm_head = nn.Linear(dims, vocab, bias=False)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def loss_fn(model, tokens, mask):
    """Next-token cross-entropy, the mean over the real tokens: predict tokens[:, 1:] from
    tokens[:, :-1]; returns (loss, number of real target tokens)."""
    logits = model(tokens[:, :-1])
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:]) * mask[:, 1:]
    ntoks = mask[:, 1:].sum()
    return ce.sum() / ntoks, ntoks


# --- the data -----------------------------------------------------------------------------


def tinystories():
    """(stories, tokenize, source) for TinyStories with GPT-2's tokenizer, when both are cached
    locally; (None, None, why) otherwise. Never downloads unless HF_HUB_OFFLINE=0 is set. The
    dataset is memory-mapped: a rank reads only the rows it asks for."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer
        from datasets import load_dataset

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        stories = load_dataset("roneneldan/TinyStories", split="train")
    except Exception as e:  # not installed, or not cached: fall back to generated stories
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return stories, lambda text: tokenizer(text)["input_ids"], "TinyStories, GPT-2 tokenizer"


NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Tim", "Lucy", "Sam"]
ANIMALS = ["cat", "dog", "bird", "bunny", "frog", "duck", "bear", "fox"]
THINGS = ["ball", "kite", "red hat", "toy car", "big box", "shiny stone", "blue cup", "book"]
PLACES = ["park", "garden", "forest", "beach", "yard", "river", "hill", "farm"]
FEELINGS = ["happy", "sad", "scared", "excited", "angry", "surprised", "proud", "sleepy"]


def generated_story(rng):
    """A short story in the style of TinyStories, from templates."""
    name, friend = rng.sample(NAMES, 2)
    animal, thing, place = rng.choice(ANIMALS), rng.choice(THINGS), rng.choice(PLACES)
    feeling, later = rng.sample(FEELINGS, 2)
    return " ".join(
        [
            rng.choice(["Once upon a time,", "One day,", "Long ago,"])
            + f" there was a little {animal} named {name}.",
            f"{name} liked to play in the {place} with a {thing}.",
            rng.choice(
                [
                    f"One day, the {thing} was lost and {name} felt {feeling}.",
                    f"Then a big wind came and took the {thing} away. {name} was {feeling}.",
                    f"But {friend} wanted the {thing} too, and {name} did not want to share.",
                ]
            ),
            rng.choice(
                [
                    f"{friend} came to help. They looked under every tree in the {place}.",
                    f'{name} asked {friend}, "Can you help me?" {friend} said, "Yes, I can!"',
                    f"{name} thought and thought. Then {name} had a good idea.",
                ]
            ),
            rng.choice(
                [
                    f"At last they found the {thing}. {name} was {later} and said thank you.",
                    f"They played with the {thing} together all day, and {name} felt {later}.",
                    f"In the end, {name} learned that sharing makes everyone {later}.",
                ]
            ),
        ]
    )


class GeneratedStories:
    """``n`` generated stories as a sequence ({"text": ...} items), each made when it is read."""

    def __init__(self, n, seed=0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": generated_story(random.Random(self.seed * 1_000_003 + i))}


def collate_with(tokenize, block):
    """Stories -> (tokens, mask): a row of block + 1 tokens per story, end-of-text after it,
    cut to length or padded with end-of-text (mask 0)."""

    def collate(items):
        tokens = np.full((len(items), block + 1), EOS, np.int32)
        mask = np.zeros((len(items), block + 1), np.float32)
        for i, item in enumerate(items):
            row = (tokenize(item["text"]) + [EOS])[: block + 1]
            tokens[i, : len(row)], mask[i, : len(row)] = row, 1
        return mx.array(tokens), mx.array(mask)

    return collate


# --- training -----------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    p.add_argument("--block", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step (default: 4)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: 3e-4)")
    p.add_argument(
        "--data",
        choices=["auto", "generated"],
        default="auto",
        help="auto: TinyStories if cached locally, else generated (default: auto)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    backend = du.initialize()  # the backend du-launch started
    rank, world = du.local_rank(backend), du.total_workers(backend)
    log = print if rank == 0 else lambda *a, **k: None

    # The stories (lazy: a rank reads and tokenizes only those of its own batches).
    stories, tokenize, source = tinystories() if args.data == "auto" else (None, None, "--data generated")
    if stories is None:
        log(f"TinyStories not available locally ({source}); using generated stories")
        stories = GeneratedStories(args.steps * args.batch_size * world, args.seed)
        tokenize, source = lambda text: list(text.encode("utf-8")), "generated stories, byte-level tokens"
    data = du.DistributedDataContainer(backend, stories, collate=collate_with(tokenize, args.block))

    mx.random.seed(args.seed)
    model = Llama()
    du.synchronize(backend, model)  # rank 0's initial weights everywhere
    opt = du.DistributedOptimizer(backend, optim.AdamW(learning_rate=args.lr))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(
        f"{type(backend).__name__}: {world} ranks; Llama with {n_params / 1e6:.1f}M parameters; "
        f"data: {source}; {args.steps} steps of {world} x {args.batch_size} x {args.block} tokens"
    )

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    step_times = []
    batches = data.batches(args.batch_size, shuffle=True, seed=args.seed)
    for step, (tokens, mask) in enumerate(itertools.islice(batches, args.steps), 1):
        tic = time.perf_counter()
        (loss, ntoks), grads = loss_and_grad(model, tokens, mask)
        opt.update(model, grads, weight=ntoks)  # the mean over every rank's tokens, then AdamW
        mx.eval(loss, model.parameters(), opt.state)
        step_times.append(time.perf_counter() - tic)
        mean_loss = du.weighted_mean(backend, loss, ntoks)  # collective: every rank calls it
        if step == 1 or step % 5 == 0 or step == args.steps:
            log(f"step {step:4d}  loss {mean_loss:.3f}  {step_times[-1] * 1000:.0f} ms")

    # Throughput and memory per rank, gathered to every rank; rank 0 prints them.
    timed = step_times[1:] or step_times  # the first step includes warm-up
    step_s = float(np.mean(timed))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux (bytes on macOS)
    mine = mx.array(
        [[args.batch_size * args.block / step_s, step_s * 1000, mx.get_peak_memory() / 2**20, rss]]
    )
    table = du.allgather(backend, mine).tolist()  # one row per rank, in rank order
    for r, (tok_s, ms, mib, rss_mib) in enumerate(table):
        log(
            f"rank {r}: {tok_s:8.0f} tokens/s  {ms:7.1f} ms/step  peak memory {mib:7.1f} MiB  peak RSS {rss_mib:7.1f} MiB"
        )
    log(f"total: {sum(row[0] for row in table):.0f} tokens/s on {world} ranks")


if __name__ == "__main__":
    main()
