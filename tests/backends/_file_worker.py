"""A fork server for the ``file`` backend's multi-process and crash tests.

Importing torch takes seconds, so instead of one fresh interpreter per writer, the tests start
this script once; it imports everything, then forks a child per command. A child is a real
second process sharing the store root (own pid, own event loop, own executor), and the crash
test kills children with SIGKILL at random moments.

Protocol: one JSON command per stdin line, one JSON reply per stdout line.
  {"op": "write", "root", "ns", "keys", "size", "forever", "max_bytes"} -> {"pid": child}
  {"op": "read", "root", "ns", "keys", "size", "out"} -> {"pid": child}  (results to ``out``)
  {"op": "wait", "pid"} -> {"status": exit status}
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _file_helpers import payload_for  # noqa: E402
from hicache_backends.file import FileStorage  # noqa: E402


async def _write(cmd: dict) -> None:
    size = cmd["size"]
    keys = cmd["keys"]
    store = FileStorage(
        None,
        root=cmd["root"],
        namespace=cmd["ns"],
        skip_existing=not cmd.get("forever", False),
        max_bytes=cmd.get("max_bytes"),
        min_free_bytes=0,
        io_threads=2,
    )
    rng = random.Random(os.getpid())
    async with store:
        while True:
            if cmd.get("forever"):
                start = rng.randrange(len(keys))
                batch = keys[start : start + rng.randint(1, 6)]
            else:
                batch = keys
            vals = [torch.frombuffer(bytearray(payload_for(k, size)), dtype=torch.uint8) for k in batch]
            ok = await store.batch_set(batch, vals)
            if not cmd.get("forever"):
                if not ok:
                    raise SystemExit(3)
                return


async def _read(cmd: dict) -> None:
    store = FileStorage(None, root=cmd["root"], namespace=cmd["ns"], min_free_bytes=0)
    out: dict[str, object] = {}
    async with store:
        targets = [torch.empty(cmd["size"], dtype=torch.uint8) for _ in cmd["keys"]]
        got = await store.batch_get(cmd["keys"], targets)
        for k, t in zip(cmd["keys"], got):
            out[k] = None if t is None else bytes(t.numpy()) == payload_for(k, cmd["size"])
        out["__exists__"] = await store.batch_exists(cmd["keys"])
    with open(cmd["out"], "w") as f:
        json.dump(out, f)


def _child(cmd: dict) -> None:
    code = 0
    try:
        asyncio.run(_write(cmd) if cmd["op"] == "write" else _read(cmd))
    except SystemExit as exc:
        code = int(exc.code or 0)
    except BaseException:  # noqa: BLE001 - report and exit non-zero
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            reply = {"status": os.waitstatus_to_exitcode(status)}
        else:
            pid = os.fork()
            if pid == 0:
                sys.stdin.close()
                os.dup2(2, 1)  # the reply pipe belongs to the server
                _child(cmd)
            reply = {"pid": pid}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
