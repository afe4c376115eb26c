"""``swarm new-model DIR``: a new model to train from scratch, in the Hugging Face layout peers and trainers load.

It writes ``config.json``, seeded random weights (``model.safetensors``) and a byte-level ``tokenizer.json``
(256 byte tokens plus specials), so ``swarm peer DIR`` can serve it and ``swarm train`` (``model_dir = DIR``)
can train it on any UTF-8 text without a tokenizer download. With no options it makes the demo's model
(tiny Llama: 8 blocks, hidden 256, seed 0). The same seed gives the same weights anywhere,
so every peer can make its own copy instead of receiving one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peers.model.tiny import make_tiny_model


def add_model_command(sub) -> None:
    new = sub.add_parser("new-model", help="make a model to train from scratch (random init, byte-level tokenizer)")
    new.add_argument("path", type=Path, help="folder to create (refused if it already holds a model)")
    new.add_argument("--family", choices=["llama", "gpt2"], default="llama", help="architecture")
    new.add_argument("--hidden_size", type=int, default=256, help="width of the hidden states")
    new.add_argument("--num_layers", type=int, default=8, help="transformer blocks (what peers split into spans)")
    new.add_argument("--num_heads", type=int, default=8, help="attention heads")
    new.add_argument("--num_kv_heads", type=int, default=None, help="llama: grouped-query heads (default: half)")
    new.add_argument("--intermediate_size", type=int, default=None, help="MLP width (default: ~2.7x hidden)")
    new.add_argument("--max_position_embeddings", type=int, default=512, help="longest sequence, in tokens")
    new.add_argument("--seed", type=int, default=0, help="the same seed makes the same weights on every machine")
    new.add_argument("--force", action="store_true", help="overwrite a model already in the folder")
    new.set_defaults(func=_cmd_new_model)


def _cmd_new_model(args: argparse.Namespace) -> int:
    path: Path = args.path
    if (path / "config.json").exists() and not args.force:
        raise ValueError(f"{path} already holds a model (config.json); choose another folder or pass --force")
    for name in ("hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    kv_heads = args.num_kv_heads or (max(1, args.num_heads // 2) if args.family == "llama" else args.num_heads)
    intermediate = args.intermediate_size or 8 * ((args.hidden_size * 8 // 3 + 7) // 8)
    make_tiny_model(path, family=args.family, hidden_size=args.hidden_size, num_layers=args.num_layers,
                    num_heads=args.num_heads, num_kv_heads=kv_heads, intermediate_size=intermediate,
                    max_position_embeddings=args.max_position_embeddings, seed=args.seed)
    print(f"Wrote a new {args.family} model to {path}: {args.num_layers} blocks, hidden {args.hidden_size}, "
          f"{args.num_heads} heads ({kv_heads} kv), MLP {intermediate}, seed {args.seed}, byte-level tokenizer.\n"
          f"Next: `swarm peer {path} --block_indices 0:{args.num_layers // 2} ...` on each peer (the same command "
          f"with the same seed makes the same model there), and `model_dir = \"{path}\"` in the `swarm train` TOML.")
    return 0
