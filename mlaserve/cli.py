"""`mlaserve <command> [<subcommand>] [flags]`: one entry point, each command in its own module.

Each command module exposes `main(argv: list[str] | None) -> int` and is imported only when run,
so that `mlaserve bench kernels` does not import the server and `mlaserve serve` does not import
matplotlib.
"""

import importlib
import sys

COMMANDS = {
    ("serve",): ("mlaserve.server.launch", "start the OpenAI-compatible server"),
    ("generate",): ("mlaserve.engine.generate_cli", "generate offline from prompts"),
    ("bench", "kernels"): ("mlaserve.bench.kernels", "time every attention kernel backend on the standard shapes"),
    ("bench", "serving"): ("mlaserve.bench.serving", "load-test an OpenAI-compatible server"),
    ("bench", "one-batch"): ("mlaserve.bench.one_batch", "one batch through a server's /generate"),
    ("eval", "gsm8k"): ("mlaserve.bench.gsm8k", "few-shot GSM8K accuracy against a server"),
    ("eval", "agreement"): ("mlaserve.bench.agreement", "logprob agreement of two engine configurations"),
}


def _usage() -> str:
    lines = ["usage: mlaserve <command> [flags]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for n in (2, 1):
        key = tuple(argv[:n])
        if key in COMMANDS:
            module = importlib.import_module(COMMANDS[key][0])
            return module.main(argv[n:]) or 0
    print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
