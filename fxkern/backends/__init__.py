"""Where fxkern's rules run inside other compilers: ``torch.compile`` (:mod:`.torch_compile`)."""
