"""The demo world: a tiny base model and LoRA adapters with known string transforms (see
`loraplex.demo.world`)."""
