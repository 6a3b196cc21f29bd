"""What a backend says when a call fails, read into one line, and what kind of failure it is.

gloo and NCCL word the same events differently, and NCCL's words run over several lines:

  gloo   "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5678. This is
         typically ..." (a peer that died), "[...] Timed out waiting 60000ms for recv operation to
         complete" (a peer that hangs, after parallel.timeout_s). The location and the advice go.
  NCCL   (torch 2.13, ProcessGroupNCCL.cpp and NCCLUtils.cpp; NCCL's ncclGetErrorString)
         "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE,
         NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60004 milliseconds before timing out."
         (a hang: the watchdog's verdict, raised by the next wait or call of the group);
         "NCCL error: remote process exited or there was a network error, NCCL version 2.27.5\n
         ncclRemoteError: ...\nLast error:\n<NCCL's last warning>" (a peer that died; "NCCL error in:
         <file>:<line>, ..." where a call itself failed);
         "NCCL communicator was aborted on rank 0. Original reason for failure was: <one of the
         above>" (a call on a group whose communicators the watchdog has aborted; the watchdog's own
         abort gives no reason, and the group's recorded error, ErrorType, says why: comm.py).

`failure_line` gives the event in one line, `failure_kind` says which: "timeout", "peer" (a peer
died or the network went), or None. parallel/dist/comm.py names the failed call with it, and
parallel/reliability/faults.py turns it into the run's `error:` line.
"""

from __future__ import annotations

import re

TIMEOUT = "timeout"
PEER = "peer"

_LOCATION = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[file:line] ", NCCL's "[Rank 0] " or "[PG ID 0 ... Rank 0] "
_NCCL_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
    r"[^)]*?Timeout\(ms\)=(?P<limit>\d+)\) ran for (?P<ran>\d+) milliseconds before timing out")
_NCCL_ABORTED = re.compile(r"NCCL communicator was aborted on rank (?P<rank>\d+)\.\s*"
                           r"(?:Original reason for failure was:\s*(?P<reason>.+))?", re.S)
_NCCL_SET_ERROR = re.compile(r"NCCL communicator encountered error set by ProcessGroupNCCL:\s*(?P<reason>.+)", re.S)
_NCCL_ERROR = re.compile(r"NCCL error(?: in: [^\n]*?:\d+)?[:,]\s*(?P<what>[^\n]*?), NCCL version (?P<version>\S+)")
_NCCL_LAST = re.compile(r"Last error:\s*\n?\s*(?P<last>[^\n]+)")
_PEER_WORDS = ("Connection closed by peer", "Connection reset", "Broken pipe",
               "remote process exited or there was a network error")


def failure_line(error: BaseException | str) -> str:
    """The failure in one line: NCCL's texts read (see the module), gloo's without its location."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else "unknown failure"
    # The aborted communicator's text holds the reason it was aborted: read first, the reason inside.
    for pattern, read in ((_NCCL_ABORTED, _aborted), (_NCCL_SET_ERROR, _set_error), (_NCCL_TIMEOUT, _timeout),
                          (_NCCL_ERROR, _nccl_error)):
        found = pattern.search(text)
        if found:
            return read(found, text)
    return _LOCATION.sub("", text.splitlines()[0]).split(". This is typically")[0]


def failure_kind(line: str) -> str | None:
    """TIMEOUT (a peer hangs, or died where nothing told: the group's timeout passed), PEER (a peer's
    connection closed: it died, or the network went), or None."""
    if "Timed out" in line or "NCCL timeout" in line:
        return TIMEOUT
    if any(words in line for words in _PEER_WORDS):
        return PEER
    return None


# torch 2.13's ErrorType, what a ProcessGroupNCCL's watchdog records on the group when it fails a collective.
_WATCHDOG_VERDICTS = {
    "TIMEOUT": "Timed out: a collective of the group ran past its timeout",
    "COMM_ERROR": "NCCL error: a collective of the group failed",
    "REMOTE_ERROR": "NCCL error: remote process exited or there was a network error (another rank's watchdog said so)",
}


def watchdog_verdict(error_type: str) -> str:
    """One line for the error NCCL's watchdog recorded on a group (ErrorType's name), in the words
    `failure_kind` reads; it aborted the group's communicators after it."""
    said = _WATCHDOG_VERDICTS.get(error_type, f"NCCL's watchdog recorded {error_type}")
    return f"{said}; NCCL's watchdog aborted the group's communicators"


def _timeout(found: re.Match, _text: str) -> str:
    return (f"Timed out: NCCL's watchdog stopped {found['op']} (collective {found['seq']} of its group) after "
            f"{int(found['ran']) / 1e3:.1f} s, past the group's timeout of {int(found['limit']) / 1e3:g} s")


def _aborted(found: re.Match, _text: str) -> str:
    if found["reason"]:
        return f"{failure_line(found['reason'])}; it aborted the group's communicators"
    return f"NCCL communicator was aborted on rank {found['rank']} (NCCL's watchdog found its group failed)"


def _set_error(found: re.Match, _text: str) -> str:
    return failure_line(found["reason"])


def _nccl_error(found: re.Match, text: str) -> str:
    last = _NCCL_LAST.search(text)
    detail = f"; last error: {last['last'].strip()}" if last else ""
    return f"NCCL error: {found['what']} (NCCL {found['version']}{detail})"
