#!/usr/bin/env python3
"""A stand-in for an agent CLI inside the VM (there is no model to talk to): records
how it was started, checks that the MCP URLs of --mcp-config answer from inside the
VM, then echoes stdin to stdout line by line (as a stream-JSON CLI would answer).

Writes STANDIN_RECORD (default ./standin.json). `--exit-with N` exits with N."""
import json
import os
import re
import sys
import urllib.request

args = sys.argv[1:]
mcp = []
for i, arg in enumerate(args):
    if arg == "--mcp-config" and i + 1 < len(args):
        for url in re.findall(r'"url"\s*:\s*"([^"]+)"', args[i + 1]):
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    mcp.append({"url": url, "status": response.status})
            except Exception as error:  # noqa: BLE001 - record any failure for the test
                mcp.append({"url": url, "error": str(error)})
record = {
    "argv": args,
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k in ("CLAUDE_CONFIG_DIR", "CODEX_HOME", "FORWARDED", "HTTPS_PROXY", "IS_SANDBOX")},
    "mcp": mcp,
    "stdin_is_tty": sys.stdin.isatty(),
}
with open(os.environ.get("STANDIN_RECORD", "standin.json"), "w") as out:
    json.dump(record, out)
for line in sys.stdin.buffer:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
if "--exit-with" in args:
    sys.exit(int(args[args.index("--exit-with") + 1]))
