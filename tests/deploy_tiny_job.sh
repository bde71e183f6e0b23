# shellcheck shell=bash
# tests/deploy_tiny_job.sh — sourced by the deploy tests (test_deploy_units, test_deploy_slurm,
# test_deploy_slurm_real): the tiny CPU job they all run. tiny_job_files DIR writes DIR/data.jsonl (24
# counting documents with 3-token prompts, ids 100-163) and DIR/drafter.json (a one-layer DFlash drafter
# of models/tiny-qwen35, taps 1 and 3).
tiny_job_files() {
    local dir=$1 d i ids mask
    for d in $(seq 0 23); do
        ids="" mask=""
        for i in $(seq 0 $((20 + d % 9))); do
            ids+="${ids:+, }$((100 + (d * 7 + i * (1 + d % 3)) % 64))"
            mask+="${mask:+, }$((i >= 3))"
        done
        echo "{\"input_ids\": [$ids], \"loss_mask\": [$mask]}"
    done >"$dir/data.jsonl"
    cat >"$dir/drafter.json" <<'JSON'
{"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
 "num_target_layers": 6, "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 3]},
 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
 "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": false,
 "max_position_embeddings": 4096, "layer_types": ["full_attention"],
 "tie_word_embeddings": false, "vocab_size": 512, "dtype": "bfloat16"}
JSON
}
