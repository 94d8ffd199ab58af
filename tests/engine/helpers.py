from engine.sampling_params import GenerationRequest, SamplingParams


def greedy(request_id: str, prompt: str, max_tokens: int = 24, **kw) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=prompt,
                             params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "In 1492, Columbus",
    "My favourite recipe for pancakes is",
    "The square root of 144 is",
    "Paris is the capital of",
    "A haiku about autumn:",
    "import numpy as np\n",
    "The largest planet in our solar system is",
    "To be or not to be,",
    "Translate to French: Good morning",
    "List three fruits:",
    "Photosynthesis is the process by which",
]
