"""vLLM's ZMQ KV-event stream in: the wire format (wire.py), the subscriber (subscriber.py),
and `kvprefetch connect vllm` (connect.py). docs/integrations/vllm.md says how to use them."""
