"""Writes opdjax/data/chat_instructions{,_sweep}.jsonl: 640 varied chat instructions from templates.

  python opdjax/data/make_chat_instructions.py

The SmolLM2 study's prompt set (configs/smollm2_study.py): everyday instructions of many kinds
(explain, list, compare, rewrite, advise, write short verse, define, plan, classify, quick
arithmetic in words), each a template filled from topic lists. Written here, so no data set is
downloaded and the licence is the project's. Deterministic (seeded shuffle): the file is shipped,
and a re-run writes the same bytes. The shuffle mixes every template into the last 128 lines, the
held-out set. chat_instructions_sweep.jsonl is the same 512 training prompts followed by the first
32 held-out ones: the short runs of scripts/reproduce.py evaluate on those (never trained on).
"""

from __future__ import annotations

import itertools
import json
import os
import random

TOPICS = ["photosynthesis", "gravity", "the water cycle", "volcanoes", "rainbows", "the moon's phases", "tides",
          "electricity", "magnets", "earthquakes", "clouds", "the seasons", "vaccines", "sleep", "recycling",
          "compound interest", "inflation", "the internet", "email", "passwords", "solar panels", "wind turbines",
          "bees", "coral reefs", "deserts", "glaciers", "black holes", "the human heart", "digestion", "muscles",
          "bread baking", "composting", "chess", "jazz", "the printing press", "democracy", "maps", "calendars",
          "batteries", "thunderstorms"]
ACTIVITIES = ["learn a new language", "start running", "save money each month", "keep houseplants alive",
              "sleep better", "prepare for a job interview", "study for an exam", "cook rice on the stove",
              "write a clear email", "organise a small desk", "make new friends in a new city", "drink more water",
              "reduce screen time", "plan a weekend trip", "learn to juggle", "take better photos with a phone",
              "stay focused while working from home", "start a vegetable garden", "clean a cast iron pan",
              "remember people's names"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a sea"), ("speed", "velocity"),
         ("a fruit", "a vegetable"), ("baking soda", "baking powder"), ("a meteor", "a comet"),
         ("a crocodile", "an alligator"), ("RAM", "storage"), ("a democracy", "a monarchy"), ("tea", "coffee"),
         ("a poem", "a song"), ("a simile", "a metaphor"), ("renting", "buying a home"), ("a frog", "a toad"),
         ("a city", "a town"), ("an atom", "a molecule"), ("a loan", "a gift"), ("walking", "cycling"),
         ("a map", "a globe")]
SUBJECTS = ["the ocean", "autumn leaves", "a cup of tea", "a rainy morning", "a lighthouse", "a sleeping cat",
            "the first snow", "a busy market", "an old bicycle", "the night sky", "a mountain path", "a garden bee",
            "a train station", "a candle", "a river at dawn", "a library", "a kite", "fresh bread", "a quiet forest",
            "a summer storm"]
PRODUCTS = ["a bakery", "a bike repair shop", "a reading app", "a dog-walking service", "a coffee cart",
            "a plant shop", "a tutoring service", "a recipe website", "a board game cafe", "a cleaning company"]
SENTENCES = ["me and him goes to the store yesterday", "the cat set on the mat all day", "their going to be late",
             "she dont like apples", "we was happy to see you", "i has two brother", "the book are on the table",
             "he run very fast last week", "they is my friends", "its a nice day isnt it"]
WORDS = ["resilient", "curious", "generous", "ancient", "fragile", "vivid", "humble", "rapid", "gentle", "brave",
         "enormous", "tiny", "ordinary", "bright", "patient"]
ANIMALS = ["a penguin", "an owl", "a dolphin", "a fox", "a giraffe", "a honeybee", "an octopus", "a camel",
           "a hedgehog", "a parrot"]
NUMBERS = [(12, 7), (25, 4), (48, 6), (9, 13), (100, 35), (64, 8), (17, 3), (81, 9), (36, 12), (50, 15)]

TEMPLATES = [
    ("Explain {t} in two sentences.", "topic"),
    ("Explain {t} to a ten-year-old.", "topic"),
    ("Give me three facts about {t}.", "topic"),
    ("Why is {t} important? Answer briefly.", "topic"),
    ("Write one question a student might ask about {t}, then answer it.", "topic"),
    ("What is a common misconception about {t}?", "topic"),
    ("Summarize the main idea of {t} in one sentence.", "topic"),
    ("Write a short quiz question about {t} with its answer.", "topic"),
    ("How would you explain {t} to someone who has never heard of it?", "topic"),
    ("Give me three tips to {a}.", "activity"),
    ("How can I {a}? Keep it short.", "activity"),
    ("What is the first step to {a}?", "activity"),
    ("Make a simple three-day plan to {a}.", "activity"),
    ("What is the difference between {x} and {y}?", "pair"),
    ("Compare {x} and {y} in one paragraph.", "pair"),
    ("Write a haiku about {s}.", "subject"),
    ("Write a four-line poem about {s}.", "subject"),
    ("Describe {s} in one vivid sentence.", "subject"),
    ("Start a short story that begins with {s}.", "subject"),
    ("Suggest three names for {p}.", "product"),
    ("Write a friendly one-sentence slogan for {p}.", "product"),
    ("Correct the grammar in this sentence: \"{g}\"", "sentence"),
    ("Give two synonyms and one antonym for the word \"{w}\".", "word"),
    ("Use the word \"{w}\" in a sentence about daily life.", "word"),
    ("What does {n} eat, and where does it live?", "animal"),
    ("Tell me one surprising fact about {n}.", "animal"),
    ("What is {i} times {j}? Explain how you got it.", "numbers"),
    ("If I have {i} apples and give away {j}, how many are left?", "numbers"),
]


def fill(template: str, kind: str) -> list[str]:
  if kind == "topic":
    return [template.format(t=t) for t in TOPICS]
  if kind == "activity":
    return [template.format(a=a) for a in ACTIVITIES]
  if kind == "pair":
    return [template.format(x=x, y=y) for x, y in PAIRS]
  if kind == "subject":
    return [template.format(s=s) for s in SUBJECTS]
  if kind == "product":
    return [template.format(p=p) for p in PRODUCTS]
  if kind == "sentence":
    return [template.format(g=g) for g in SENTENCES]
  if kind == "word":
    return [template.format(w=w) for w in WORDS]
  if kind == "animal":
    return [template.format(n=n) for n in ANIMALS]
  return [template.format(i=i, j=j) for i, j in NUMBERS]


def prompts(n: int = 640, seed: int = 0) -> list[str]:
  """`n` distinct prompts, drawn round-robin over the templates so each template is represented
  in proportion, then shuffled."""
  rng = random.Random(seed)
  pools = []
  for template, kind in TEMPLATES:
    pool = fill(template, kind)
    rng.shuffle(pool)
    pools.append(pool)
  out = [p for p in itertools.chain.from_iterable(itertools.zip_longest(*pools)) if p is not None][:n]
  if len(out) < n:
    raise ValueError(f"the templates give {len(out)} prompts, fewer than {n}.")
  rng.shuffle(out)
  return out


def main() -> None:
  rows = prompts()
  here = os.path.dirname(os.path.abspath(__file__))
  # The full set, and the sweeps' set: the same 512 training prompts and the first 32 of the 128
  # held out (a held-out evaluation is most of a short run's cost on CPU).
  for name, lines in (("chat_instructions", rows), ("chat_instructions_sweep", rows[:-128] + rows[-128:-96])):
    path = os.path.join(here, f"{name}.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps({"prompt": p}) + "\n" for p in lines)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
