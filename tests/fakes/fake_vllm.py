"""An 'engine' whose progress is visible only through its own Prometheus
counters (as with CUDA graphs, where collectives never reach Python).

    python fake_vllm.py --port P [--freeze-after S]

Serves vLLM's metric families on /metrics: generation tokens grow while one
request runs; after --freeze-after seconds the counter stops while the request
stays "running" (the hang signature). No torch, no supervisor code.
"""

import argparse
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()
ARGS = None


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        elapsed = time.monotonic() - START
        frozen = ARGS.freeze_after is not None and elapsed > ARGS.freeze_after
        tokens = int(min(elapsed, ARGS.freeze_after or elapsed) * 100)
        body = (
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {tokens}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {1 if frozen or elapsed > 0 else 0}\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--freeze-after", type=float, default=None)
    p.add_argument("--run-for", type=float, default=None)
    ARGS = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(ARGS.run_for if ARGS.run_for else 10**9)
    server.shutdown()


if __name__ == "__main__":
    main()
