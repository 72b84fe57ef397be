# Shared by the benchmark scripts (sourced): background processes stopped on exit, and waiting for
# a line a process prints when it is ready.

# PIDs to stop (SIGINT, then wait) when the script exits, however it exits.
pids=()
cleanup() {
  # Only the background jobs not waited for yet: a process already waited for is gone, and its
  # number may be another process's by now.
  local p running=" $(jobs -p | tr '\n' ' ') "
  for p in "${pids[@]}"; do
    if [[ "$running" == *" $p "* ]]; then kill -INT "$p" 2>/dev/null || true; fi
  done
  wait 2>/dev/null || true
  if declare -F pin_cleanup >/dev/null; then pin_cleanup; fi
}
trap cleanup EXIT

# wait_line FILE PATTERN: waits up to 10 s for PATTERN to appear in FILE.
wait_line() {
  for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  echo "timed out waiting for $2 in $1" >&2
  exit 1
}

# start_sims N URL_FILE [FLAG...]: starts N simulated replicas (one `headroom sim` process, $bin, on
# the system-under-test cores with PIN=1) on ephemeral ports, their URLs one per line in URL_FILE
# and their log beside it; waits up to 10 s.
start_sims() {
  local n=$1 file=$2
  shift 2
  "${sut_on[@]}" "$bin" sim --replicas "$n" --port 0 "$@" >"$file" 2>"${file%.url}.log" &
  pids+=($!)
  for _ in $(seq 200); do [ "$(grep -c http "$file" 2>/dev/null)" = "$n" ] && return 0; sleep 0.05; done
  echo "the simulator did not start: see ${file%.url}.log" >&2
  exit 1
}

# cpu_of PID: CPU ticks (user + system) of a process and of its child processes.
cpu_of() {
  local split
  split=$(cpu_split_of "$@")
  echo $(( ${split% *} + ${split#* } ))
}

# cpu_split_of PID: "USER SYSTEM", the CPU ticks of a process and of its child processes spent in
# user space and in the kernel.
cpu_split_of() {
  local user=0 system=0 p
  for p in "$@" $(pgrep -P "$1" 2>/dev/null || true); do
    [ -r "/proc/$p/stat" ] || continue
    read -r u s < <(awk '{print $14, $15}' "/proc/$p/stat")
    user=$(( user + u )) system=$(( system + s ))
  done
  echo "$user $system"
}

# stream_trace FILE N TOKENS [LONG_EVERY LONG_TOKENS]: the overhead benchmarks' trace: N requests of
# 64-token prompts and TOKENS-token answers, no reuse; with LONG_EVERY > 0 every LONG_EVERY-th is
# instead a LONG_TOKENS-token prompt with a one-token answer (so the streams' ITL is the short
# requests' alone).
stream_trace() {
  python3 - "$1" "$2" "$3" "${4:-0}" "${5:-100000}" <<'PY'
import json, sys
path, n, tokens, every, long_tokens = sys.argv[1], *map(int, sys.argv[2:])
with open(path, "w") as f:
    for i in range(n):
        if every and i % every == every - 1:
            blocks = -(-long_tokens // 512)
            row = {"timestamp": 0, "input_length": long_tokens, "output_length": 1,
                   "hash_ids": [10**9 + blocks * i + b for b in range(blocks)], "block_tokens": 512}
        else:
            row = {"timestamp": 0, "input_length": 64, "output_length": tokens,
                   "hash_ids": [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], "block_tokens": 16}
        f.write(json.dumps(row) + "\n")
PY
}

# start_stream_replica MODEL TTFT_MS ITL_MS DIR: the overhead benchmarks' replica, one simulated
# engine with a step-free or constant timing model and room for every stream, on the load cores
# beside the load generator; sets replica_url and replica_pid (its URL and log in DIR).
start_stream_replica() {
  : >"$4/sim.url"
  "${load_on[@]}" "$bin" sim --port 0 --latency-model "$1" --time-to-first-token "$2" \
    --inter-token-latency "$3" --max-num-seqs 4096 --num-gpu-blocks 1000000 \
    >"$4/sim.url" 2>"$4/sim.log" &
  replica_pid=$!
  pids+=($replica_pid)
  wait_line "$4/sim.url" http
  replica_url=$(grep -m1 http "$4/sim.url")
}

source "$(dirname "${BASH_SOURCE[0]}")/pin.sh"

# need_tcpdump, defined apart so that a script can check for it before its builds.
source "$(dirname "${BASH_SOURCE[0]}")/tools.sh"

# start_wire_capture PCAP LOG PORT...: captures on lo the TCP packets to or from any PORT that
# carry a payload or open or end a connection (no bare ACKs), the reader run through wire_on (the
# load cores: the capture's kernel side runs in each sender's system call, alike for every proxy,
# and its reader must not take a proxy's core); -Z root: the file is written where the script
# writes. Waits until it listens; sets wire_pid.
start_wire_capture() {
  local pcap=$1 log=$2 ports="port $3"
  shift 3
  local port
  for port in "$@"; do ports+=" or port $port"; done
  "${wire_on[@]}" tcpdump -Z root -i lo -s 0 -B 262144 --time-stamp-precision nano -w "$pcap" \
    "tcp and ($ports) and ((ip[2:2] - ((ip[0]&0xf)<<2) - ((tcp[12]&0xf0)>>2)) != 0 or tcp[tcpflags] & (tcp-syn|tcp-fin|tcp-rst) != 0)" \
    2>"$log" &
  wire_pid=$!
  pids+=($wire_pid)
  wait_line "$log" "listening on"
}

# free_port: a loopback TCP port nothing listens on (bound and let go: free unless taken since).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_port PORT SECONDS WHAT: waits up to SECONDS for a listener on 127.0.0.1:PORT; otherwise
# says WHAT did not start and exits.
wait_port() {
  python3 - "$1" "$2" <<'PY' || { echo "$3 did not start (nothing listens on 127.0.0.1:$1)" >&2; exit 1; }
import socket, sys, time
port, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.05)
PY
}

# nginx_conf DIR PORT UPSTREAM WORKERS [PREAMBLE]: writes DIR/nginx.conf, the reference proxy of the
# overhead benchmarks: nginx as a plain unbuffered SSE reverse proxy on 127.0.0.1:PORT in front of
# UPSTREAM (host:port), HTTP/1.1 keep-alive to it, WORKERS worker processes, no access log; PREAMBLE
# (main-context directives, e.g. `daemon off;`) goes first.
nginx_conf() {
  local dir=$1 port=$2 upstream=$3 workers=$4 preamble=${5:-}
  mkdir -p "$dir/logs" "$dir/body" "$dir/proxy"
  cat >"$dir/nginx.conf" <<NGINX_CONF
$preamble
worker_processes $workers;
error_log $dir/logs/error.log warn;
pid $dir/nginx.pid;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $dir/body;
  proxy_temp_path $dir/proxy;
  upstream replica { server $upstream; keepalive 512; }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://replica;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      client_max_body_size 0;
      proxy_read_timeout 300s;
    }
  }
}
NGINX_CONF
}
