"""Training: the DFlash drafter and target trainers, the demo pair recipe and its text data (never imported by
the serving path: engine/, prefill_node/, decode_node/, kv_bridge/, cluster/)."""
