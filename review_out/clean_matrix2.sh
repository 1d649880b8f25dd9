# attack 2/1 continued: more clean fleets (exact-zero rule, resumes at other world sizes); every one must PASS
cd "$(dirname "$0")/.."
run() { echo "== $1 $2"; python review_out/clean.py /tmp/rv/$1 "$2" 2>&1 | grep -v "^  ok"; }
run fsdp_exact '{"shard":"fsdp","reduce":"exact","profile":"3,3"}'
run bf16wire '{"reduce":"bf16"}'
run fsdp_adamw '{"shard":"fsdp","profile":"3,3","opt":"adamw","lr":0.01,"seed":4}'
run mixed_micro '{"profile":"4x32,2x64","micro_batch":2,"seed":9}'
run up3 '{"profile":"3,3","resume_world":3}'
run small_adamw '{"preset":"small","opt":"adamw","seed":10,"steps":3}'
run exact_up3 '{"reduce":"exact","profile":"3,3","resume_world":3,"seed":2}'
