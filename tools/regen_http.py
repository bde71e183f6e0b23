"""tools/regen_http.py — the HTTP side of tools/regenerate.py: an OpenAI-compatible endpoint (keep-alive
connections per thread), one call with its retries and backoff, the served model's name, and the exceptions that
say what became of a sample. Standard library only."""
import argparse
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare_data as pd  # noqa: E402 — its DataError is the one-line refusal

RETRY_STATUS = {408, 429}          # and every 5xx
SKIP_STATUS = {400, 413, 422}      # the server refuses this sample (too long for the context, ...)
MAX_DELAY_S = 60.0


class Fatal(Exception):
    """Stops the run (the endpoint, the model or the output is wrong)."""


class Skip(Exception):
    """Skips one sample; args: (kind, reason)."""


class Exhausted(Exception):
    """A request failed --max-retries + 1 times; stops the run unless --on-error skip."""


class Stopped(Exception):
    """The run is stopping; the sample is abandoned (a resume does it again)."""


# ----------------------------------------------------------------------------------------------------------
# HTTP


class Endpoint:
    """An OpenAI-compatible server's base URL; one keep-alive connection per thread."""

    def __init__(self, url, timeout, api_key):
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise pd.DataError(f"--endpoint '{url}' is not an http(s) URL")
        path = u.path.rstrip("/")
        if path.endswith("/v1"):
            path = path[:-3]
        self.scheme, self.host, self.port, self.prefix = u.scheme, u.hostname, u.port, path + "/v1"
        self.url = f"{u.scheme}://{u.netloc}{self.prefix}"
        self.timeout, self.api_key = timeout, api_key
        self.local = threading.local()

    def once(self, method, path, body=None):
        """One attempt: (status, response headers, body bytes). Raises OSError or http.client.HTTPException."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = self.local.conn = cls(self.host, self.port, timeout=self.timeout)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            r = conn.getresponse()
            payload = r.read()
        except BaseException:
            conn.close()
            self.local.conn = None
            raise
        if r.will_close:
            conn.close()
            self.local.conn = None
        return r.status, r.headers, payload


def error_text(payload):
    try:
        obj = json.loads(payload)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:300]
    except ValueError:
        pass
    return payload[:300].decode("utf-8", "replace").strip() or "(empty body)"


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.retries = 0

    def retry(self):
        with self.lock:
            self.retries += 1


def call(ep, method, path, body, opt, counters, stop):
    """The decoded JSON answer of one request, retried on connection errors, timeouts, 408, 429 and 5xx."""
    last = ""
    for attempt in range(opt.max_retries + 1):
        if stop.is_set():
            raise Stopped()
        wait, at_once = None, False
        try:
            status, headers, payload = ep.once(method, path, body)
        except (OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                at_once = True  # most often a keep-alive connection the server closed while idle
        else:
            if status == 200:
                try:
                    return json.loads(payload)
                except ValueError:
                    last = "HTTP 200 with a body that is not JSON"
            else:
                last = f"HTTP {status}: {error_text(payload)}"
                if status in SKIP_STATUS:
                    raise Skip("refused", last)
                if status not in RETRY_STATUS and status < 500:
                    raise Fatal(f"{method} {ep.url}{path}: {last}")
                try:
                    wait = float(headers.get("Retry-After"))
                except (TypeError, ValueError):
                    wait = None
        if attempt == opt.max_retries:
            break
        counters.retry()
        delay = 0.0 if at_once else min(opt.backoff * 2 ** attempt, MAX_DELAY_S)
        if wait is not None:
            delay = max(delay, min(wait, MAX_DELAY_S))
        if stop.wait(delay):
            raise Stopped()
    raise Exhausted(last)


def pick_model(ep, want, opt, counters):
    """The model to ask for: want, checked against GET /models, or the only one listed."""
    opt = argparse.Namespace(max_retries=min(opt.max_retries, 3), backoff=opt.backoff)  # a few seconds, not minutes
    try:
        obj = call(ep, "GET", "/models", None, opt, counters, threading.Event())
    except Exhausted as e:
        raise Fatal(f"cannot reach the endpoint {ep.url} (GET /models: {e}); is the server up?")
    except (Skip, Fatal) as e:
        raise Fatal(f"the endpoint {ep.url} does not answer GET /models as an OpenAI-compatible server: "
                    f"{e.args[-1]}")
    data = obj.get("data") if isinstance(obj, dict) else None
    names = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(data, list) else []
    if not names:
        raise Fatal(f"the endpoint {ep.url} lists no model (GET /models)")
    if want is None:
        if len(names) > 1:
            raise Fatal(f"the endpoint {ep.url} serves {len(names)} models ({', '.join(names)}); pick one with "
                        "--model")
        return names[0]
    if want not in names:
        raise Fatal(f"the endpoint {ep.url} does not serve the model '{want}'; it serves {', '.join(names)}")
    return want
