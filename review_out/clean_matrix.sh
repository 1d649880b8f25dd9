# attack 2 (false alarms): clean fleets across configurations; every one must PASS
cd "$(dirname "$0")/.."
run() { echo "== $1 $2"; python review_out/clean.py /tmp/rv/$1 "$2" 2>&1 | grep -v "^  ok"; }
run seed1 '{"seed":1}'
run seed2 '{"seed":2,"steps":5}'
run seed3 '{"seed":3}'
run adamw '{"opt":"adamw","lr":0.01}'
run small '{"preset":"small","steps":3}'
run fsdp '{"shard":"fsdp","profile":"3,3"}'
run mixed '{"profile":"4x32,2x64"}'
run micro '{"micro_batch":1}'
run exact '{"reduce":"exact","profile":"3,3"}'
run seq '{"data_order":"sequential","seed":5}'
run world3 '{"world":3,"profile":"2,2,2","resume_world":2}'
