"""``swarm chat``: an interactive chat in the terminal, through the swarm.

The conversation is kept and rendered with the model's chat template (``peers/api/chat_template.py``) for every
reply, which streams as it comes. Ctrl-C stops the current reply (what was shown stays in the history), not the
program; ``/reset`` forgets the conversation, ``/exit`` or end of input (Ctrl-D) quits. When the conversation no
longer fits in the context, its oldest turns are dropped (the system prompt stays). Read from a pipe, it prints
only the replies, one per line, so that it can be scripted.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import TextIO

from peers.cli.api import client_flags, open_engine

logger = logging.getLogger(__name__)
HELP = "Type a message; /reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply."


def add_chat_command(sub) -> None:
    chat = sub.add_parser("chat", help="chat with the model in this terminal, through the swarm",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    client_flags(chat)
    chat.add_argument("--system", default=None, help="a system prompt that opens the conversation (default: none)")
    chat.add_argument("--max_tokens", type=int, default=256, help="longest reply, in tokens")
    chat.add_argument("--temperature", type=float, default=0.7, help="0: greedy (always the most likely token)")
    chat.add_argument("--top_p", type=float, default=0.9, help="sample from the smallest set reaching this mass")
    chat.add_argument("--seed", type=int, default=None,
                      help="makes sampling reproducible (default: a new seed each run)")
    chat.set_defaults(func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError("--max_tokens must be >= 1")
    client, engine = open_engine(args, args.max_tokens)
    try:
        Chat(engine, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
             top_p=args.top_p, seed=args.seed).run(sys.stdin, sys.stdout)
    finally:
        client.close()
    return 0


class Chat:
    def __init__(self, engine, *, system: str | None, max_tokens: int, temperature: float, top_p: float,
                 seed: int | None) -> None:
        self.engine, self.system, self.max_tokens = engine, system, max_tokens
        self.sampling = dict(temperature=temperature, top_p=top_p, seed=seed)
        engine.job([0], max_tokens=1, **self.sampling)  # bad sampling flags fail now, not at the first reply
        self.history: list[dict[str, str]] = []

    def run(self, stdin: TextIO, out: TextIO) -> None:
        interactive = stdin.isatty()
        if interactive:
            template = "its chat template" if self.engine.template.has_template else "a plain User:/Assistant: format"
            print(f"Chatting with {self.engine.model_id} ({template}). {HELP}", file=out, flush=True)
        while True:
            try:
                line = input(">>> ") if interactive else stdin.readline()
            except KeyboardInterrupt:
                print(f"\n{HELP}", file=out, flush=True)
                continue
            except EOFError:
                line = ""
            if not line:  # end of input
                break
            text = line.strip()
            if text == "/exit":
                break
            if text == "/reset":
                self.history.clear()
                if interactive:
                    print("(conversation cleared)", file=out, flush=True)
                continue
            if text:
                self.reply(text, out)

    def reply(self, text: str, out: TextIO) -> None:
        """Answer ``text`` with the history; stream the reply to ``out`` and keep it."""
        self.history.append({"role": "user", "content": text})
        job = self._job()
        if job is None:
            self.history.pop()
            return
        shown: list[str] = []
        try:
            with contextlib.closing(self.engine.client.loop.iterate(self.engine.stream(job))) as deltas:
                for delta in deltas:  # Ctrl-C anywhere in here closes the session on the peers at once
                    print(delta.text, end="", file=out, flush=True)
                    shown.append(delta.text)
            print(file=out, flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", file=out, flush=True)
        except (ValueError, RuntimeError, ConnectionError, TimeoutError) as e:
            print(file=out, flush=True)
            logger.error("The reply failed: %s", e)
            self.history.pop()  # as if the message had not been sent
            return
        self.history.append({"role": "assistant", "content": "".join(shown)})

    def _job(self):
        """The next reply's job; drops the oldest turns while the conversation and a whole reply do not fit in the
        context (a single message too long for a whole reply gets a shorter one)."""
        from peers.api.engine import ContextError

        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            prompt_ids, stops = self.engine.chat_prompt(system + self.history)
            try:
                return self.engine.job(prompt_ids, max_tokens=self.max_tokens, stops=stops, **self.sampling)
            except ContextError as e:
                if len(self.history) > 1:
                    del self.history[:2]  # the oldest user message and its reply
                    logger.warning("The conversation no longer fits in the context: dropped its oldest turn")
                    continue
                try:
                    return self.engine.job(prompt_ids, max_tokens=None, stops=stops, **self.sampling)
                except ContextError:
                    logger.error("This message does not fit: %s", e)
                    return None
