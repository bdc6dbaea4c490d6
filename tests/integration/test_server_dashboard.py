"""End-to-end: GET /v1/stats and GET /dashboard on a real `tessera serve` under streaming load.

A gateway with an API key and a real roofline report (`tessera bench roofline --json`, tiny
sizes): two deployments of the default model, `chunked` (the default stack) and `spec` (plus
drafter.ngram), an ab-split router `ab` over them, and the exact cache with a tiny in-process
budget in front of a real redis-server (so answers come from both tiers; without
redis-server the in-process tier alone). 16 clients stream completions through the router,
each a sticky user, half their requests repeated prompts (cache hits). Checked:
- both routes need the key (bearer; the page also takes ?key=), and /v1/stats needs GET;
- under load, every /v1/stats counter lies between two /metrics scrapes taken around it,
  the series are one column per key, ending within one sampling interval of the reply;
- headless Chromium (Debian's `chromium`) renders the page under load: every chart has data
  points, its headline counters lie between /metrics scrapes taken before and after the page
  ran (one polling interval), the roofline panel shows the recorded report; a screenshot is
  saved (TESSERA_DASHBOARD_SCREENSHOT, default BUILD/test-scratch/dashboard.png);
- the per-deployment, per-arm and per-tier panels: every chart has a line with points for
  each deployment (the drafter's acceptance for `spec`), arm and tier; their tables' counters
  lie between the labelled /metrics samples (deployment=, router=/arm=, result=/tier=)
  scraped around the page's run;
- once the load stopped, /v1/stats and the rendered page equal /metrics exactly: counters,
  gauges, and window percentiles against Prometheus-style histogram_quantile over the
  /metrics buckets (the window covers the server's whole life), per deployment and per arm
  too.
"""
import html.parser
import http.client
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=())
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    h.skip_or_fail("headless Chromium is missing (Debian package 'chromium'; run scripts/install-deps.sh)")

KEY = "dash-test-key"
CLIENTS = 16
SERVER = None
MODEL = "ab"  # the router: every request is routed, then looked up in the cache
DEPLOYMENTS = ["chunked", "spec"]  # in config order, as the page lists them
REDIS = None
ROOFLINE = None
SCREENSHOT = os.environ.get("TESSERA_DASHBOARD_SCREENSHOT",
                            os.path.join(h.BUILD_DIR, "test-scratch", "dashboard.png"))
# Longer than a few KV blocks (16 tokens each), so requests share cached prefix blocks.
SHARED_PREFIX = ("You are a careful assistant for a lighthouse museum. Answer visitors' questions about the "
                 "history of the lighthouse, its keepers, the lens, the fog signal and the island's birds in "
                 "two or three plain sentences, and say so when you do not know.")
CHARTS = ["requests", "queue", "ttft", "tpot", "itl", "throughput", "batch", "kv", "preemptions", "prefix"]
# Breakdown charts and the lines each must draw (one per deployment, arm or tier).
DEPLOYMENT_CHARTS = ["dep-queue", "dep-ttft", "dep-tpot", "dep-batch", "dep-kv", "dep-preemptions", "dep-prefix"]
ARM_CHARTS = ["route-share", "arm-ttft", "arm-tpot", "arm-queue"]
# Requests repeated by every client (same parameters): the exact cache answers them.
REPEATED = [f"Name one thing a lighthouse keeper did every evening, number {k}." for k in range(6)]


def get(path, key=KEY, method="GET"):
    """(status, body bytes) of a request to the server."""
    req = urllib.request.Request(SERVER.url + path, method=method)
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stats(window=900):
    status, body = get(f"/v1/stats?window={window}")
    assert status == 200, body
    return json.loads(body)


def parse_metrics(text):
    """{name or name{labels}: value} of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metrics():
    return parse_metrics(SERVER.metrics())


def labels_of(name):
    """(family, {label: value}) of a parse_metrics key."""
    if "{" not in name:
        return name, {}
    family, rest = name.split("{", 1)
    return family, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))


def labelled(m, family, **want):
    """The sum of `family`'s samples whose labels include `want`."""
    total = 0.0
    for name, v in m.items():
        f, labels = labels_of(name)
        if f == family and all(labels.get(k) == w for k, w in want.items()):
            total += v
    return total


def buckets_of(m, family, want):
    """[(upper bound, cumulative count)] of histogram `family` with exactly the labels `want`
    in /metrics, ascending."""
    buckets = []
    for name, v in m.items():
        f, labels = labels_of(name)
        le = labels.pop("le", None)
        if f == family + "_bucket" and le is not None and labels == want:
            buckets.append((math.inf if le == "+Inf" else float(le), v))
    return sorted(buckets)


def quantile_from_metrics(m, family, q, **want):
    """Prometheus histogram_quantile over the cumulative buckets of `family` (with the labels
    `want`) in /metrics."""
    buckets = buckets_of(m, family, want)
    total = buckets[-1][1]
    if total == 0:
        return None
    rank = q * total
    prev_bound, prev_cum = 0.0, 0.0
    for bound, cum in buckets:
        if cum > prev_cum and cum >= rank:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_cum) / (cum - prev_cum)
        prev_bound, prev_cum = bound, cum
    return prev_bound


def fraction_from_metrics(m, family, x, **want):
    """The share of `family`'s observations at most x, interpolated in its /metrics buckets
    (the +Inf bucket never counts)."""
    buckets = buckets_of(m, family, want)
    total = buckets[-1][1]
    within, prev_bound, prev_cum = 0.0, 0.0, 0.0
    for bound, cum in buckets:
        if math.isinf(bound):
            break
        if x >= bound:
            within = cum
        elif x > prev_bound:
            within = prev_cum + (cum - prev_cum) * (x - prev_bound) / (bound - prev_bound)
        prev_bound, prev_cum = bound, cum
    return within / total


# Counters of /v1/stats "current" and the /metrics sample each one reports.
COUNTERS = [
    (("requests", "finished_sequences_total"), "tessera_engine_finished_sequences_total"),
    (("tokens", "prompt_total"), "tessera_prompt_tokens_total"),
    (("tokens", "generation_total"), "tessera_generation_tokens_total"),
    (("engine", "steps_total"), "tessera_engine_steps_total"),
    (("engine", "batch_tokens_total"), "tessera_engine_batch_tokens_total"),
    (("engine", "preemptions_total"), "tessera_engine_preemptions_total"),
    (("prefix_cache", "query_tokens_total"), "tessera_prefix_cache_query_tokens_total"),
    (("prefix_cache", "hit_tokens_total"), "tessera_prefix_cache_hit_tokens_total"),
    (("latency", "ttft_seconds", "count"), "tessera_time_to_first_token_seconds_count"),
    (("latency", "itl_seconds", "count"), "tessera_inter_token_latency_seconds_count"),
]
GAUGES = [
    (("requests", "in_flight"), "tessera_requests_in_flight"),
    (("requests", "running"), "tessera_engine_running_sequences"),
    (("requests", "waiting"), "tessera_engine_waiting_sequences"),
    (("kv", "blocks_total"), "tessera_kv_blocks_total"),
    (("kv", "blocks_used"), "tessera_kv_blocks_used"),
    (("kv", "blocks_cached"), "tessera_kv_blocks_cached"),
    (("prefix_cache", "hit_rate"), "tessera_prefix_cache_hit_rate"),
]
LATENCIES = [("queue_time_seconds", "tessera_queue_time_seconds"),
             ("ttft_seconds", "tessera_time_to_first_token_seconds"),
             ("tpot_seconds", "tessera_time_per_output_token_seconds"),
             ("itl_seconds", "tessera_inter_token_latency_seconds")]


def dig(d, path):
    for k in path:
        d = d[k]
    return d


class Load:
    """CLIENTS threads, each streaming completions back to back until stop()."""

    def __init__(self):
        self.stop_event = threading.Event()
        self.completed = 0
        self.errors = []
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def client(self, i):
        n = 0
        while not self.stop_event.is_set():
            # A shared prefix (prefix-cache hits) and a per-request tail; every fourth request
            # one of REPEATED, asked twice in a row: the first is a Redis hit once another
            # client of the same arm asked it and the tiny in-process tier has evicted it, the
            # second an in-process hit (just stored, or copied from Redis). The user picks the
            # arm (ab-split is sticky per user).
            if n % 4 >= 2:
                prompt, max_tokens = REPEATED[(i + n // 4) % len(REPEATED)], 24
            else:
                prompt, max_tokens = SHARED_PREFIX + f" Client {i}, request {n}:", 16 + (7 * i + 5 * n) % 33
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": True, "user": f"user-{i}"})
            n += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", SERVER.port, timeout=120)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                               "Authorization": "Bearer " + KEY})
                r = conn.getresponse()
                data = r.read().decode()
                conn.close()
                if r.status != 200 or "data: [DONE]" not in data:
                    self.errors.append(f"{r.status}: {data[:200]}")
                else:
                    self.completed += 1
            except Exception as e:  # noqa: BLE001 (reported by the test)
                self.errors.append(repr(e))

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(180)


class DomScan(html.parser.HTMLParser):
    """Per element id: its attributes; per chart: the series groups and their drawn shapes."""

    def __init__(self):
        super().__init__()
        self.by_id = {}
        self.stack = []
        self.shapes = {}  # chart id -> number of path/rect/circle elements inside it
        self.body = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if "id" in a:
            self.by_id[a["id"]] = a
        # The chart's svg (its lines' groups are chart-ID:N).
        chart = next((s for s in reversed(self.stack) if s and s.startswith("chart-") and ":" not in s), None)
        if chart and tag in ("path", "rect", "circle"):
            self.shapes[chart] = self.shapes.get(chart, 0) + 1
        if tag not in ("br", "img", "meta", "input", "link", "hr", "line", "rect", "circle", "path"):
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if tag not in ("br", "img", "meta", "input", "link", "hr", "line", "rect", "circle", "path") and self.stack:
            self.stack.pop()


def chromium(url, *mode, budget_ms=7000, height=1000):
    profile = tempfile.mkdtemp(prefix="tessera-chromium-")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size=1400,{height}",
           f"--virtual-time-budget={budget_ms}", *mode, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    shutil.rmtree(profile, ignore_errors=True)
    return r


def page_url(key=KEY):
    return f"{SERVER.url}/dashboard?key={key}&window=60&interval=2&slo_queue=1&slo_ttft=0.5&slo_tpot=0.2"


def render_page():
    r = chromium(page_url(), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    scan = DomScan()
    scan.feed(r.stdout)
    return scan


def setUpModule():
    global SERVER, REDIS, ROOFLINE
    work = h.scratch_dir("tessera-dashboard-")
    ROOFLINE = os.path.join(work, "roofline.json")
    r = subprocess.run([h.TESSERA, "bench", "roofline", "-c", os.path.join(h.SOURCE_DIR, "configs", "bench", "roofline.yaml"),
                        "--max-batch", "8", "--steps", "3", "--json", ROOFLINE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        REDIS = h.Redis().start()
    # A tiny in-process budget (about two answers) in front of Redis: most repeats are
    # answered by Redis, the latest ones from memory.
    redis = (f', max_bytes: 4KiB, redis_url: "redis://127.0.0.1:{REDIS.port}"' if REDIS else ", max_bytes: 64KiB")
    stack = f"extends: {h.DEFAULT_STACK}, engine: {{kv_cache: {{plugin: paged, memory: 64MiB}}"
    SERVER = h.Gateway(f"""deployments:
  chunked: {{{stack}}}}}
  spec: {{{stack}, drafter: {{plugin: ngram, num_draft_tokens: 4, min_ngram: 1, max_ngram: 3, adaptive: false}}}}}}
gateway:
  cache: [{{plugin: exact, ttl: 10m{redis}}}]
  router: {{plugin: ab-split, name: ab, arms: {{chunked: 50, spec: 50}}}}
server: {{api_keys: [{KEY}], max_queued_requests: 256}}
""", "dashboard")
    SERVER.args = ["--roofline-report", ROOFLINE]
    SERVER.start(timeout=240)
    status, body = get("/v1/models")
    assert status == 200, body
    assert {m["id"] for m in json.loads(body)["data"]} == set(DEPLOYMENTS) | {MODEL}, body


def tearDownModule():
    rc = SERVER.stop()
    if REDIS:
        REDIS.kill()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


class Dashboard(unittest.TestCase):
    def test_1_routes_need_the_api_key(self):
        self.assertEqual(get("/v1/stats", key=None)[0], 401)
        self.assertEqual(get("/v1/stats", key="wrong")[0], 401)
        self.assertEqual(get("/v1/stats?key=" + KEY, key=None)[0], 401)  # only the page takes ?key=
        self.assertEqual(get("/v1/stats", method="POST")[0], 405)
        self.assertEqual(get("/dashboard", key=None)[0], 401)
        self.assertEqual(get("/dashboard?key=wrong", key=None)[0], 401)
        status, page = get("/dashboard?key=" + KEY, key=None)
        self.assertEqual(status, 200)
        self.assertIn(b"/v1/stats", page)  # the page's script polls it and draws the charts as SVG
        self.assertEqual(get("/dashboard")[0], 200)  # a bearer header works too
        # No fetches anywhere else: no absolute URLs in the page at all.
        self.assertIsNone(re.search(rb"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page))
        status, body = get("/v1/stats?window=abc")
        self.assertEqual(status, 400)
        self.assertIn(b"window", body)

    def test_2_under_load_stats_match_metrics_and_the_page_renders(self):
        load = Load().start()
        try:
            # Long enough to fill most of the page's 1-minute window (and the screenshot), and
            # until every cache tier has answered at least once: how soon Redis answers depends
            # on how many requests a loaded machine completes (evictions from the tiny
            # in-process tier), not on a fixed time.
            tiers = ["memory", "redis"] if REDIS else ["memory"]

            def every_tier_hit():
                m = metrics()
                return all(labelled(m, "tessera_cache_requests_total", result="hit", tier=t) > 0 for t in tiers)

            start = time.time()
            while (load.completed < 2 * CLIENTS or time.time() < start + 35 or not every_tier_hit()) and \
                    time.time() < start + 240:
                time.sleep(0.5)
            self.assertGreaterEqual(load.completed, 2 * CLIENTS, load.errors[:3])

            before = metrics()
            s = stats(window=60)
            after = metrics()
            self.assertGreater(s["current"]["requests"]["in_flight"], 0)
            for path, name in COUNTERS:
                v = dig(s["current"], path)
                self.assertLessEqual(before[name], v, name)
                self.assertLessEqual(v, after[name], name)
            self.assertEqual(s["current"]["kv"]["blocks_total"], after["tessera_kv_blocks_total"])
            self.assertNotIn("speculative", s["current"])  # this stack has no drafter
            series = s["series"]
            n = len(series["t"])
            self.assertGreater(n, 5)
            for key, column in series.items():
                self.assertEqual(len(column), n, key)
            # The newest point is less than one polling interval of the page (2 s) old.
            self.assertLess(s["time"] - series["t"][-1], 2.0)
            self.assertGreater(max(v for v in series["output_tokens_per_s"] if v is not None), 0)
            self.assertGreater(max(v for v in series["running"] if v is not None), 0)
            self.assertTrue(any(v is not None for v in series["ttft_p50"]))
            self.assertGreater(s["window"]["output_tokens_per_s"], 0)
            self.assertTrue(s["window"]["prefix_cache_hit_rate"] > 0)
            self.check_breakdown_json(s, before, after, n)

            # The page, under the same load: each chart has points, headline counters within
            # the /metrics scrapes around the page's run (it polls every 2 s).
            before = metrics()
            scan = render_page()
            after = metrics()
            self.assertNotIn("data-error", scan.body, scan.body)
            self.assertGreaterEqual(int(scan.body.get("data-polls", "0")), 1)
            for chart in CHARTS:
                svg = scan.by_id["chart-" + chart]
                self.assertGreater(int(svg["data-points"]), 0, chart)
                self.assertGreater(scan.shapes.get("chart-" + chart, 0), 0, chart)
            self.assertIn("hidden", scan.by_id["panel-speculative"])
            for latency in ("queue", "ttft", "tpot"):  # the targets page_url asks for
                self.assertTrue(0 <= float(scan.by_id["within-" + latency]["data-value"]) <= 1, latency)
            self.assertNotIn("within-itl", scan.by_id)
            for tile, name in [("tile-finished", "tessera_engine_finished_sequences_total"),
                               ("tile-generated", "tessera_generation_tokens_total"),
                               ("tile-steps", "tessera_engine_steps_total"),
                               ("value-preemptions", "tessera_engine_preemptions_total")]:
                v = float(scan.by_id[tile]["data-value"])
                self.assertLessEqual(before[name], v, tile)
                self.assertLessEqual(v, after[name], tile)
            self.assertGreater(float(scan.by_id["tile-generated"]["data-value"]), 0)
            self.check_breakdown_page(scan, before, after)
            report = json.load(open(ROOFLINE))
            self.assertEqual(float(scan.by_id["value-roofline"]["data-value"]), report["knee_batch"])
            self.assertEqual(int(scan.by_id["chart-roofline"]["data-points"]), 2 * len(report["points"]))

            os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
            if os.path.exists(SCREENSHOT):
                os.remove(SCREENSHOT)
            # Tall enough for the breakdowns below the headline panels.
            r = chromium(page_url(), f"--screenshot={SCREENSHOT}", budget_ms=9000, height=2250)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            with open(SCREENSHOT, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertGreater(os.path.getsize(SCREENSHOT), 20000)
            print(f"screenshot: {SCREENSHOT}")
        finally:
            load.stop()
        self.assertEqual(load.errors, [])

    def check_breakdown_json(self, s, before, after, n):
        """/v1/stats per deployment, arm and tier under load: labelled counters between two
        /metrics scrapes, series columns as long as the top-level ones."""
        self.assertEqual([d["name"] for d in s["deployments"]], DEPLOYMENTS)
        self.assertEqual([d["drafter"] for d in s["deployments"]], [None, "ngram"])
        for d in s["deployments"]:
            lab = {"deployment": d["name"]}
            for path, family in [(("engine", "steps_total"), "tessera_deployment_engine_steps_total"),
                                 (("engine", "preemptions_total"), "tessera_deployment_engine_preemptions_total"),
                                 (("prefix_cache", "hit_tokens_total"), "tessera_deployment_prefix_cache_hit_tokens_total"),
                                 (("latency", "ttft_seconds", "count"),
                                  "tessera_deployment_time_to_first_token_seconds_count")]:
                v = dig(d["current"], path)
                self.assertLessEqual(labelled(before, family, **lab), v, (d["name"], family))
                self.assertLessEqual(v, labelled(after, family, **lab), (d["name"], family))
            self.assertGreater(d["current"]["latency"]["ttft_seconds"]["count"], 0, d["name"])
            self.assertEqual(d["current"]["kv"]["blocks_total"], labelled(after, "tessera_deployment_kv_blocks_total", **lab))
            columns = s["deployment_series"][d["name"]]
            for key, column in columns.items():
                self.assertEqual(len(column), n, (d["name"], key))
        spec = s["deployments"][1]["current"]["speculative"]
        self.assertGreater(spec["draft_tokens_total"], 0)
        self.assertNotIn("speculative", s["deployments"][0]["current"])
        [router] = s["routers"]
        self.assertEqual(router["name"], "ab")
        self.assertEqual(sorted(a["name"] for a in router["arms"]), sorted(DEPLOYMENTS))
        for a in router["arms"]:
            family = "tessera_router_requests_total"
            self.assertLessEqual(labelled(before, family, router="ab", arm=a["name"]), a["requests_total"])
            self.assertLessEqual(a["requests_total"], labelled(after, family, router="ab", arm=a["name"]))
            self.assertGreater(a["requests_total"], 0, a["name"])
            for key, column in s["router_series"]["ab"][a["name"]].items():
                self.assertEqual(len(column), n, (a["name"], key))
        tiers = sorted(s["cache"]["tiers"])
        self.assertEqual(tiers, ["memory", "redis"] if REDIS else ["memory"])
        for t in tiers:
            v = s["cache"]["tiers"][t]["hits_total"]
            family = "tessera_cache_requests_total"
            self.assertLessEqual(labelled(before, family, result="hit", tier=t), v, t)
            self.assertLessEqual(v, labelled(after, family, result="hit", tier=t), t)
            self.assertGreater(v, 0, t)
        self.assertEqual(sorted(s["cache_series"]["tiers"]), tiers)

    def check_breakdown_page(self, scan, before, after):
        """The rendered page's per-deployment, per-arm and per-tier charts and tables."""
        tiers = ["memory", "redis"] if REDIS else ["memory"]
        lines = {c: len(DEPLOYMENTS) for c in DEPLOYMENT_CHARTS}
        lines.update({c: len(DEPLOYMENTS) for c in ARM_CHARTS})
        lines.update({"dep-spec": 1, "cache-tiers": len(tiers) + 1, "cache-rate": 2})
        for chart, n in lines.items():
            self.assertNotIn("hidden", scan.by_id["panel-" + chart], chart)
            self.assertGreater(int(scan.by_id["chart-" + chart]["data-points"]), 0, chart)
            for i in range(n):
                g = scan.by_id.get(f"chart-{chart}:{i}")
                self.assertIsNotNone(g, f"{chart}: line {i} is missing")
                self.assertGreater(int(g["data-points"]), 0, f"{chart}: line {i} ({g['data-series']})")
            self.assertNotIn(f"chart-{chart}:{n}", scan.by_id, f"{chart}: more than {n} lines")
        self.assertEqual(scan.by_id["chart-dep-spec:0"]["data-series"], "spec (ngram)")

        def between(el, family, **lab):
            v = float(scan.by_id[el]["data-value"])
            self.assertLessEqual(labelled(before, family, **lab), v, el)
            self.assertLessEqual(v, labelled(after, family, **lab), el)
            return v

        for i, name in enumerate(DEPLOYMENTS):
            self.assertEqual(scan.by_id[f"dep-{i}"]["data-name"], name)
            self.assertGreater(between(f"dep-{i}-served", "tessera_deployment_time_to_first_token_seconds_count",
                                       deployment=name), 0)
            between(f"dep-{i}-preemptions", "tessera_deployment_engine_preemptions_total", deployment=name)
            between(f"dep-{i}-cache-hits", "tessera_cache_requests_total", deployment=name, result="hit")
            self.assertEqual(float(scan.by_id[f"dep-{i}-kv-total"]["data-value"]),
                             labelled(after, "tessera_deployment_kv_blocks_total", deployment=name))
        self.assertEqual(scan.by_id["dep-1-drafter"]["data-value"], "ngram")
        self.assertGreater(float(scan.by_id["dep-1-acceptance"]["data-value"]), 0)
        self.assertEqual(scan.by_id["dep-0-acceptance"]["data-value"], "")
        arms = [scan.by_id[f"arm-{j}"]["data-name"] for j in range(len(DEPLOYMENTS))]
        self.assertEqual(sorted(arms), sorted("ab=" + d for d in DEPLOYMENTS))
        for j, name in enumerate(arms):
            self.assertGreater(between(f"arm-{j}-requests", "tessera_router_requests_total", router="ab",
                                       arm=name.split("=", 1)[1]), 0)
        for k, t in enumerate(tiers):
            self.assertEqual(scan.by_id[f"tier-{k}"]["data-name"], t)
            self.assertGreater(between(f"tier-{k}-hits", "tessera_cache_requests_total", result="hit", tier=t), 0)

    def test_3_idle_stats_and_page_equal_metrics(self):
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0, timeout=120))
        time.sleep(5.5)  # every sample of the newest series point (up to 5 s each) is idle
        m = metrics()
        s = stats(window=900)
        self.assertLess(s["uptime_s"], 900, "the window must cover the server's life for this check")
        for path, name in COUNTERS + GAUGES:
            self.assertAlmostEqual(dig(s["current"], path), m[name], places=9, msg=name)
        for key, family in LATENCIES:
            for q, qn in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")]:
                want = quantile_from_metrics(m, family, q)
                got = s["window"]["latency"][key][qn]
                self.assertIsNotNone(want, family)
                self.assertAlmostEqual(got, want, places=9, msg=f"{key} {qn}")
            self.assertEqual(s["window"]["latency"][key]["count"], m[family + "_count"])
        self.assertAlmostEqual(s["window"]["output_tokens_per_s"] * s["window"]["span_s"],
                               m["tessera_generation_tokens_total"], delta=1e-6 * m["tessera_generation_tokens_total"])
        # The newest series point shows the idle engine.
        self.assertEqual(s["series"]["running"][-1], 0)
        self.assertEqual(s["series"]["kv_blocks_used"][-1], m["tessera_kv_blocks_used"])
        # Per deployment and per arm: the labelled families.
        for d in s["deployments"]:
            lab = {"deployment": d["name"]}
            for key, family in [("queue_time_seconds", "tessera_deployment_queue_time_seconds"),
                                ("ttft_seconds", "tessera_deployment_time_to_first_token_seconds"),
                                ("tpot_seconds", "tessera_deployment_time_per_output_token_seconds")]:
                self.assertEqual(d["window"]["latency"][key]["count"], labelled(m, family + "_count", **lab))
                for qn, q in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)]:
                    self.assertAlmostEqual(d["window"]["latency"][key][qn], quantile_from_metrics(m, family, q, **lab),
                                           places=9, msg=(d["name"], key, qn))
            for path, family in [(("engine", "steps_total"), "tessera_deployment_engine_steps_total"),
                                 (("engine", "preemptions_total"), "tessera_deployment_engine_preemptions_total"),
                                 (("kv", "blocks_used"), "tessera_deployment_kv_blocks_used"),
                                 (("kv", "blocks_cached"), "tessera_deployment_kv_blocks_cached"),
                                 (("prefix_cache", "query_tokens_total"),
                                  "tessera_deployment_prefix_cache_query_tokens_total")]:
                self.assertEqual(dig(d["current"], path), labelled(m, family, **lab), (d["name"], family))
            self.assertEqual(d["cache"]["hits_total"], labelled(m, "tessera_cache_requests_total", result="hit", **lab))
        spec = s["deployments"][1]["current"]["speculative"]
        self.assertAlmostEqual(spec["acceptance_rate"],
                               labelled(m, "tessera_deployment_spec_decode_num_accepted_tokens_total", deployment="spec") /
                               labelled(m, "tessera_deployment_spec_decode_num_draft_tokens_total", deployment="spec"),
                               places=12)
        total = labelled(m, "tessera_router_requests_total", router="ab")
        for a in s["routers"][0]["arms"]:
            lab = {"router": "ab", "arm": a["name"]}
            self.assertEqual(a["requests_total"], labelled(m, "tessera_router_requests_total", **lab))
            self.assertAlmostEqual(a["window"]["share"], a["requests_total"] / total, places=12)
            for qn, q in [("p50", 0.5), ("p90", 0.9)]:
                self.assertAlmostEqual(a["window"]["latency"]["ttft_seconds"][qn],
                                       quantile_from_metrics(m, "tessera_router_time_to_first_token_seconds", q, **lab),
                                       places=9, msg=(a["name"], qn))
        self.assertEqual(s["cache"]["lookups_total"], labelled(m, "tessera_cache_requests_total"))
        self.assertEqual(s["cache"]["misses_total"], labelled(m, "tessera_cache_requests_total", result="miss"))
        for t, v in s["cache"]["tiers"].items():
            self.assertEqual(v["hits_total"], labelled(m, "tessera_cache_requests_total", result="hit", tier=t))

        # The page's headline values are the same numbers (the 15-minute window).
        r = chromium(f"{SERVER.url}/dashboard?key={KEY}&window=900&slo_ttft=0.75", "--dump-dom")
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        scan = DomScan()
        scan.feed(r.stdout)
        self.assertEqual(float(scan.by_id["slo-ttft"]["data-value"]), 0.75)  # the target line asked for
        self.assertNotIn("slo-tpot", scan.by_id)
        self.assertNotIn("within-tpot", scan.by_id)
        m = metrics()
        # Against the standard: the share of sequences within the target, from the same buckets.
        self.assertAlmostEqual(float(scan.by_id["within-ttft"]["data-value"]),
                               fraction_from_metrics(m, "tessera_time_to_first_token_seconds", 0.75), places=9)
        status, body = get("/v1/stats?window=900&slo_queue=0.3&slo_ttft=0.75")
        self.assertEqual(status, 200, body)
        j = json.loads(body)
        self.assertEqual(j["window"]["latency"]["ttft_seconds"]["within_target"]["target"], 0.75)
        self.assertNotIn("within_target", j["window"]["latency"]["tpot_seconds"])
        for i, name in enumerate(DEPLOYMENTS):
            self.assertAlmostEqual(j["deployments"][i]["window"]["latency"]["queue_time_seconds"]["within_target"]["fraction"],
                                   fraction_from_metrics(m, "tessera_deployment_queue_time_seconds", 0.3, deployment=name),
                                   places=9, msg=name)
        self.assertEqual(get("/v1/stats?slo_ttft=-1")[0], 400)
        for el, want in [("value-ttft", quantile_from_metrics(m, "tessera_time_to_first_token_seconds", 0.5)),
                         ("value-tpot", quantile_from_metrics(m, "tessera_time_per_output_token_seconds", 0.5)),
                         ("value-itl", quantile_from_metrics(m, "tessera_inter_token_latency_seconds", 0.5)),
                         ("value-queue", quantile_from_metrics(m, "tessera_queue_time_seconds", 0.5)),
                         ("value-kv", m["tessera_kv_blocks_used"]),
                         ("value-requests", m["tessera_engine_running_sequences"]),
                         ("value-prefix", m["tessera_prefix_cache_hit_rate"]),
                         ("tile-generated", m["tessera_generation_tokens_total"]),
                         ("tile-finished", m["tessera_engine_finished_sequences_total"])]:
            self.assertAlmostEqual(float(scan.by_id[el]["data-value"]), want, places=9, msg=el)
        # The breakdown tables: per deployment, per arm, per tier.
        for i, name in enumerate(DEPLOYMENTS):
            lab = {"deployment": name}
            for el, family, q in [("ttft-p50", "tessera_deployment_time_to_first_token_seconds", 0.5),
                                  ("ttft-p90", "tessera_deployment_time_to_first_token_seconds", 0.9),
                                  ("tpot-p50", "tessera_deployment_time_per_output_token_seconds", 0.5),
                                  ("queue-p90", "tessera_deployment_queue_time_seconds", 0.9)]:
                self.assertAlmostEqual(float(scan.by_id[f"dep-{i}-{el}"]["data-value"]),
                                       quantile_from_metrics(m, family, q, **lab), places=9, msg=(name, el))
            self.assertEqual(float(scan.by_id[f"dep-{i}-kv-used"]["data-value"]),
                             labelled(m, "tessera_deployment_kv_blocks_used", **lab))
        self.assertAlmostEqual(float(scan.by_id["dep-1-acceptance"]["data-value"]),
                               labelled(m, "tessera_deployment_spec_decode_num_accepted_tokens_total", deployment="spec") /
                               labelled(m, "tessera_deployment_spec_decode_num_draft_tokens_total", deployment="spec"),
                               places=9)
        for j in range(len(DEPLOYMENTS)):
            arm = scan.by_id[f"arm-{j}"]["data-name"].split("=", 1)[1]
            lab = {"router": "ab", "arm": arm}
            self.assertEqual(float(scan.by_id[f"arm-{j}-requests"]["data-value"]),
                             labelled(m, "tessera_router_requests_total", **lab))
            self.assertAlmostEqual(float(scan.by_id[f"arm-{j}-ttft-p50"]["data-value"]),
                                   quantile_from_metrics(m, "tessera_router_time_to_first_token_seconds", 0.5, **lab),
                                   places=9, msg=arm)
        for k in range(len(s["cache"]["tiers"])):
            t = scan.by_id[f"tier-{k}"]["data-name"]
            self.assertEqual(float(scan.by_id[f"tier-{k}-hits"]["data-value"]),
                             labelled(m, "tessera_cache_requests_total", result="hit", tier=t))


if __name__ == "__main__":
    sys.exit(h.run_tests([Dashboard]))
