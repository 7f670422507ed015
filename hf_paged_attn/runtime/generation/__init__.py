"""What turns logits into tokens: sampling, transformers' processors, beams, lockstep rows, grammars."""
