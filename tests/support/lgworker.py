"""A LangGraph worker for the kill test: a graph whose "charge" node makes one external call
(an HTTP POST to the target, through ``LedgerSaver.call_once``), then a "receipt" node.

    python -m tests.support.lgworker DSN THREAD TARGET_URL MARKS [--hold]

Each run of the charge node appends a line to MARKS after its call; with ``--hold`` it then
waits to be killed (the call is made, the node has not returned: LangGraph saved no write).
Without it, the graph is resumed from the thread's last checkpoint and run to the end.
"""

from __future__ import annotations

import argparse
import json
import operator
import time
import urllib.request
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from ledger_cdc.integrations.langgraph import LedgerSaver


class Order(TypedDict):
    log: Annotated[list[str], operator.add]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dsn")
    p.add_argument("thread")
    p.add_argument("target")
    p.add_argument("marks")
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()
    saver = LedgerSaver.from_dsn(a.dsn)
    config: Any = {"configurable": {"thread_id": a.thread}}

    def post() -> int:
        req = urllib.request.Request(
            a.target,
            data=json.dumps({"amount": 42}).encode(),
            method="POST",
            headers={"Idempotency-Key": f"{a.thread}:charge"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)

    def charge(state: Order) -> dict[str, Any]:
        status = saver.call_once(
            config, "charge", "payments.charge", post, arguments={"amount": 42}
        )
        with open(a.marks, "a") as f:
            f.write(f"charge ran, status {status}\n")
        if a.hold:
            time.sleep(120)  # killed here
        return {"log": [f"charged {status}"]}

    def receipt(state: Order) -> dict[str, Any]:
        return {"log": ["receipt sent"]}

    g = StateGraph(Order)
    g.add_node("charge", charge)
    g.add_node("receipt", receipt)
    g.add_edge(START, "charge")
    g.add_edge("charge", "receipt")
    g.add_edge("receipt", END)
    graph = g.compile(checkpointer=saver)
    state = graph.get_state(config)
    out = graph.invoke(None if state.next else {"log": []}, config)
    print(json.dumps(out["log"]))
    saver.close()


if __name__ == "__main__":
    main()
