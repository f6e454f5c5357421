"""`kvfree chat`: a terminal chat on a server session, streamed as it is generated.

Each turn sends the whole conversation with the session's id; the server keeps the state and prefills only the new
part. Commands:

    /fork         continue on a copy of the session (the old one stays as it was)
    /save FILE    download the session's snapshot to FILE (and the conversation to FILE.messages.json)
    /load FILE    continue from a saved snapshot (and its conversation, when FILE.messages.json exists)
    /session      show the session (id, tokens consumed, where its state is)
    /quit         leave (the session stays on the server)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

import httpx

from kvfree.clients.client import KvfreeClient
from kvfree.clients.types import KvfreeAPIError

HELP = __doc__.split("Commands:")[1]


class ChatSession:
    """The conversation on the client side: its messages and the server session that holds its state."""

    def __init__(self, client: KvfreeClient, out: TextIO, system: str | None, params: dict) -> None:
        self.client, self.out, self.params = client, out, params
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.session = client.create_session(messages=self.messages or None)

    def say(self, text: str) -> None:
        """One user turn, the reply streamed to `out`."""
        self.messages.append({"role": "user", "content": text})
        reply = []
        for delta in self.client.chat_stream(self.messages, session_id=self.session.id, **self.params):
            self.out.write(delta.text)
            self.out.flush()
            reply.append(delta.text)
        self.out.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def command(self, line: str) -> bool:
        """Run a /command; False when the chat should end."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/quit":
            return False
        if name == "/fork":
            self.session = self.client.fork_session(self.session.id)
            self.out.write(f"[forked: now on session {self.session.id}]\n")
        elif name == "/save" and arg:
            path = Path(arg)
            path.write_bytes(self.client.snapshot(self.session.id))
            _messages_file(path).write_text(json.dumps(self.messages, ensure_ascii=False))
            self.out.write(f"[saved session {self.session.id} to {path}]\n")
        elif name == "/load" and arg:
            path = Path(arg)
            self.session = self.client.restore(path.read_bytes())
            history = _messages_file(path)
            self.messages = json.loads(history.read_text()) if history.is_file() else []
            self.out.write(f"[loaded {path}: session {self.session.id}, {self.session.num_tokens} tokens]\n")
        elif name == "/session":
            s = self.client.get_session(self.session.id)
            self.out.write(f"[session {s.id}: {s.num_tokens} tokens, on {s.location}, {s.state_bytes:,} bytes]\n")
        else:
            self.out.write(f"[commands:{HELP}]\n")
        return True


def _messages_file(path: Path) -> Path:
    return path.with_name(path.name + ".messages.json")


def main(argv: list[str] | None = None, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfree chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="bearer key (default: $KVFREE_API_KEY)")
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    import os

    api_key = args.api_key or os.environ.get("KVFREE_API_KEY")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        with KvfreeClient(args.url, api_key=api_key) as client:
            chat = ChatSession(client, out, args.system, params)
            out.write(f"[session {chat.session.id}; /help for commands, /quit to leave]\n")
            while True:
                out.write("> ")
                out.flush()
                line = stdin.readline()
                if not line:
                    break
                line = line.strip()
                if not line:
                    continue
                try:
                    if line.startswith("/"):
                        if not chat.command(line):
                            break
                    else:
                        chat.say(line)
                except (KvfreeAPIError, OSError) as exc:  # a refused turn or an unreadable file: say so, go on
                    out.write(f"[error: {exc}]\n")
    except (KvfreeAPIError, httpx.HTTPError) as exc:
        print(f"kvfree chat: cannot talk to {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
