"""An RL-style loop on the bundled model: generate rollouts, update the weights in place, generate again.

    python examples/rl_loop.py [--steps 3]

Each step samples completions for a few prompts with transformers' own continuous-batching API
(``model.generate_batch``, what TRL's ``GRPOTrainer`` calls with ``use_transformers_continuous_batching=True``),
scores them with a toy reward (shorter completions that end with a period score higher), and takes
one REINFORCE-like gradient step on the same model object, in place. The next step's rollouts come
from the updated weights: every ``generate_batch`` builds its engine (pages, prefix cache, graphs)
for that call, so nothing computed with the old weights is reused. The model is left in training
mode, as the loop set it. Runs in seconds on CPU.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import ContinuousBatchingConfig

import hf_paged_attn  # noqa: F401  registers attn_implementation="paged"
from hf_paged_attn.demo import DEMO_MODEL

PROMPTS = ["The for statement", "A list is", "Exceptions are raised when", "The import statement"]


def reward(text: str) -> float:
    return (1.0 if text.rstrip().endswith(".") else 0.0) - 0.01 * len(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampling = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=50)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(args.samples)]
    model.train()
    for step in range(args.steps):
        with torch.no_grad():  # rollouts: eval mode inside, training mode again after
            outputs = model.generate_batch(prompts, generation_config=sampling, progress_bar=False,
                                           continuous_batching_config=ContinuousBatchingConfig(seed=step))  # fmt: skip
        rollouts = [(o.prompt_ids, o.generated_tokens) for o in outputs.values()]
        rewards = torch.tensor([reward(tokenizer.decode(new)) for _, new in rollouts])
        advantages = rewards - rewards.mean()
        # One policy-gradient step: raise the log-likelihood of completions that beat the mean
        optimizer.zero_grad()
        loss = torch.zeros(())
        for (prompt, new), advantage in zip(rollouts, advantages):
            ids = torch.tensor([prompt + new])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [new, vocab]: each new token's logits
            logprob = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(new)[:, None]).sum()
            loss = loss - advantage * logprob / len(rollouts)
        loss.backward()
        optimizer.step()  # the weights change in place; the next generate_batch sees them
        sample = tokenizer.decode(rollouts[0][1])
        print(f"step {step}: mean reward {rewards.mean():+.3f}  loss {loss.item():+.3f}  "
              f"training={model.training}  e.g. {sample[:60]!r}")  # fmt: skip


if __name__ == "__main__":
    main()
