"""Run one compiler command and kill everything it started as soon as the builder is gone.

nvcc runs cudafe++, cicc, ptxas and the host compiler as child processes and does not stop them
when its own parent dies: a killed builder used to leave them running, reparented to init, for
seconds of CPU that slowed the rebuild that followed. The builder therefore starts this file as
``python -I -S reaper.py <compiler argv...>`` in a process group of its own, with a pipe on stdin
that it never writes. End of file on that pipe means the builder exited, was killed (SIGKILL too:
the kernel closes its descriptors) or gave up (timeout, interrupt); this process then kills its
whole group, the compiler and all its children included. It sits outside the builder's process
group, so signals sent to that group (Ctrl-C, killpg) reach it only through the pipe.

Standard library only, no dsv4jit import: it starts in milliseconds.
"""

import os
import signal
import subprocess
import sys
import threading


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the builder decides, and tells us by closing the pipe
    try:
        compiler = subprocess.Popen(argv, stdin=subprocess.DEVNULL)  # inherits our process group
    except OSError as e:
        print(f"error: cannot run {argv[0]}: {e.strerror}", flush=True)
        return 127

    def kill_group(*_) -> None:
        os.killpg(0, signal.SIGKILL)  # our own group: this process, the compiler and its children

    signal.signal(signal.SIGTERM, kill_group)

    def watch() -> None:
        while os.read(0, 4096):  # the raw descriptor: a buffered read would hold a lock at exit
            pass
        kill_group()  # end of file

    threading.Thread(target=watch, daemon=True).start()
    code = compiler.wait()
    if code < 0:  # died of a signal: die of it too, so the builder can tell an OOM kill
        if code != -signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
