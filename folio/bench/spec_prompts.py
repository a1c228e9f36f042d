"""Chat prompts for speculative decoding: copy-heavy ones, whose answers repeat spans of
the prompt (repeat, fix or quote a text), and free-form ones. Used by
benchmarks/spec_decode.py and the speculative-decoding tests; fixed text, so runs
compare."""
from __future__ import annotations

LIGHTHOUSE = """\
The lighthouse at Kettle Point was built in 1871 from granite quarried on the island \
itself. Its first keeper, a retired ship's carpenter named Elias Brandt, kept a log of \
every vessel that passed within sight of the lamp. The log survives in the county \
archive: forty-one volumes, each bound in oilcloth, each page divided into columns for \
the date, the hour, the weather, the name of the ship and a remark. Most remarks are \
short. "Fog from the west, bell rung four hours." "Schooner Mary Ellen, low in the \
water, making for harbour." "Lamp trimmed twice, wick poor." Some are longer. In the \
winter of 1879 Brandt wrote three pages about a storm that tore the roof from the oil \
store and drove a brig onto the northern reef, where its crew clung to the rigging \
until the tide fell and the keeper could wade out with a rope. All eleven men were \
saved. The brig was lost. The keeper's hands were frostbitten, and for two months the \
entries are written in his daughter's careful script. When the lamp was automated in \
1963 the last keeper, Brandt's great-grandson, carried the final volume to the \
archive himself. He wrote one more line in it before he handed it over: "Light left \
burning. Nobody here to see it."
"""

GARDEN = """\
To start a vegetable garden, choose a spot that gets at least six hours of direct sun \
each day and drains well after rain. Clear the grass and weeds, then loosen the soil \
to a depth of about thirty centimetres with a fork. Work in two or three centimetres \
of compost across the whole bed. Plan the layout before you plant: put tall crops such \
as tomatoes, beans and sweetcorn on the north side so that they do not shade the \
shorter ones. Leave paths wide enough to kneel on, because you will spend more time \
weeding than you expect. Sow lettuce, radishes and peas as soon as the soil can be \
worked in spring; wait until the last frost has passed before planting tomatoes, \
peppers, squash and cucumbers. Water deeply once or twice a week rather than a little \
every day, so that the roots grow down instead of staying near the surface. Mulch \
between the rows with straw or shredded leaves to keep the soil moist and the weeds \
down. Check the plants every morning for pests; most problems are easy to handle if \
you catch them early. Harvest often: many crops, beans and courgettes above all, \
produce more when they are picked young. At the end of the season, pull out the spent \
plants, add them to the compost heap unless they were diseased, and cover the bed \
with a layer of manure or a sown green manure such as clover. Next year, move each \
family of crops to a different bed, so that pests and diseases do not build up in \
the soil.
"""

LRU_CODE = """\
class LRUCache:
    \"\"\"A fixed-size cache that evicts the least recently used entry.\"\"\"

    def __init__(self, capacity):
        self.capacity = capacity
        self.entries = {}
        self.order = []

    def get(self, key):
        if key not in self.entries:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.entries[key]

    def put(self, key, value):
        if key in self.entries:
            self.order.remove(key)
        elif len(self.entries) > self.capacity:
            oldest = self.order.pop(0)
            del self.entries[oldest]
        self.entries[key] = value
        self.order.append(key)

    def __len__(self):
        return len(self.entries)

    def keys(self):
        return list(self.order)

    def __contains__(self, key):
        return key in self.entries

    def resize(self, capacity):
        self.capacity = capacity
        while len(self.entries) > self.capacity:
            oldest = self.order.pop(0)
            del self.entries[oldest]
"""

CONFIG_CODE = """\
def load_settings(path):
    settings = {"host": "127.0.0.1", "port": 8080, "workers": 4, "debug": False}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"line {number}: expected key=value")
            key, value = key.strip(), value.strip()
            if key not in settings:
                raise ValueError(f"line {number}: unknown key {key}")
            default = settings[key]
            if isinstance(default, bool):
                settings[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                settings[key] = int(value)
            else:
                settings[key] = value
    return settings


def save_settings(path, settings):
    with open(path, "w") as f:
        for key in sorted(settings):
            value = settings[key]
            if isinstance(value, bool):
                value = "true" if value else "false"
            f.write(f"{key} = {value}\n")
"""

MINUTES = """\
Minutes of the allotment committee, 4 March. Present: R. Okafor (chair), J. Lindqvist, \
M. Ferreira, P. Nakamura, S. Byrne. Apologies: T. Walsh. Item 1: the water supply. The \
mains tap by the north gate has been repaired; the cost was 212 pounds, paid from the \
maintenance fund. Members are reminded to close the tap after use. Item 2: plot \
inspections will take place on the first Saturday of May, June and July. Plots that \
are more than half covered in weeds will receive a written warning; a second warning \
means the plot may be offered to the next person on the waiting list. Item 3: the \
waiting list now holds 37 names. The committee agreed to divide two of the larger \
vacant plots into half plots to shorten it. Item 4: the open day will be held on 14 \
June. M. Ferreira will organise the plant sale and P. Nakamura the tea stall. Item 5: \
any other business. S. Byrne reported that rats have been seen near the compost bays; \
members must not put cooked food in the compost. J. Lindqvist asked whether the \
committee would buy a second wheelbarrow; agreed, up to 60 pounds. P. Nakamura \
proposed a seed swap before the open day; agreed, date to be set at the next \
meeting. Next meeting: 1 April, 7 pm, in the hut.
"""

COPY_TASKS = [
    ("Repeat the following text exactly, word for word:\n\n", LIGHTHOUSE),
    ("Fix the bug in this code (the cache can grow past its capacity) and show the "
     "whole corrected class:\n\n", LRU_CODE),
    ("Quote this passage in full, then say in one sentence what it is about:\n\n", GARDEN),
    ("Rewrite this function with the same behaviour and add a docstring; show the whole "
     "function:\n\n", CONFIG_CODE),
    ("Repeat these minutes exactly as written:\n\n", MINUTES),
]

CHAT_TASKS = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea at night.",
    "Give me three tips for staying focused while studying.",
    "Explain in simple words why the sky is blue.",
    "Suggest a name for a friendly robot and describe its personality.",
]


def copy_messages(max_chars: int | None = None) -> list[list[dict]]:
    """One conversation per copy-heavy task (texts cut to ``max_chars`` when given)."""
    return [[{"role": "user", "content": ask + (text[:max_chars] if max_chars else text)}]
            for ask, text in COPY_TASKS]


def chat_messages() -> list[list[dict]]:
    """One conversation per free-form question."""
    return [[{"role": "user", "content": question}] for question in CHAT_TASKS]
