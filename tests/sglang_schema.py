"""SGLang 0.5.23's `/generate` schema, as data (test helper).

Read in the sglang-0.5.23 wheel from PyPI (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl,
sha256 00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937), by listing the annotated
fields of each class (the order is the source order):

  * GENERATE_REQ_INPUT_FIELDS: sglang/srt/managers/io_struct.py, `@dataclass class GenerateReqInput`
    (the object FastAPI builds from the body of `POST /generate`,
    sglang/srt/entrypoints/http_server.py `generate_request`);
  * GENERATE_REQUEST_CONTRACT_FIELDS: sglang/api/v1/api_types.py, `class GenerateRequest`
    ("JSON object (unknown keys ignored)"), which `generate_request` checks every body against
    first (`generate_contract_error`, sglang/srt/entrypoints/api_contract.py);
  * SAMPLING_PARAMS_FIELDS: sglang/api/v1/api_types.py, `class SamplingParams` ("JSON object
    (unknown keys rejected)");
  * GENERATE_RESPONSE_FIELDS / GENERATE_META_INFO_FIELDS: api_types.py `GenerateResponse` /
    `GenerateMetaInfo`; the speculative-decoding keys are added to meta_info by
    sglang/srt/managers/tokenizer_manager.py `TokenizerManager._calculate_spec_decoding_metrics`.
"""

VERSION = "0.5.23"

GENERATE_REQ_INPUT_FIELDS = (
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
)

GENERATE_REQUEST_CONTRACT_FIELDS = (
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_hidden_states", "return_text_in_logprobs", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank",
    "image_data", "mm_hashes", "video_data", "audio_data", "extra_key", "priority", "cache_salt", "require_reasoning",
    "lora_path", "session_params", "kv_hints", "routing_key", "max_thinking_tokens", "session_id",
    "custom_logit_processor", "custom_labels", "images_config", "return_prompt_token_ids", "routed_experts_start_len",
    "return_sampling_mask", "modalities",
)

SAMPLING_PARAMS_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)

GENERATE_RESPONSE_FIELDS = ("text", "meta_info", "output_ids", "index", "prompt_token_ids")

GENERATE_META_INFO_FIELDS = (
    "id", "prompt_tokens", "completion_tokens", "finish_reason", "output_token_logprobs", "input_token_logprobs",
    "output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs", "input_token_ids_logprobs",
    "hidden_states", "e2e_latency", "cached_tokens", "reasoning_tokens", "output_token_logprobs_length",
    "weight_version", "weight_versions", "image_tokens", "audio_tokens", "video_tokens",
)
SPEC_META_INFO_FIELDS = (
    "spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
    "spec_correct_drafts_histogram",
)
