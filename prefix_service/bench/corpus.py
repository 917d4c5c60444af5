"""Sentences the benchmark builds its user prompts from: customer messages for the intent
templates, question forms for the departures-board template. Deterministic: a request's text
depends only on its workload and index."""
from __future__ import annotations

import random
import re
from typing import Iterator

CUSTOMER_SENTENCES = (
    "I ordered the Alpine 40L backpack nine days ago and the tracking page still says the label was created.",
    "Could you tell me when my order will arrive? I need the tent before a trip on Friday.",
    "The rain jacket I received has a torn seam along the left sleeve, it was like that in the box.",
    "Please cancel my order, I bought the same sleeping bag in a shop near my house.",
    "I was charged twice for the same order and both payments are showing on my card statement.",
    "The promo code SUMMER15 did not apply at checkout even though the banner said it was valid.",
    "Is the Ridge 2 tent waterproof enough for a week of rain in the Scottish Highlands?",
    "Can I still change the size of the fleece in my order from medium to large before it ships?",
    "My hiking boots are too narrow, how do I send them back and how long does the refund take?",
    "The zip on my down jacket broke after three trips, can it be repaired under the warranty?",
    "I cannot log in to my account, the password reset email never arrives in my inbox.",
    "Please change the delivery address of my order to my office, the parcel should go to Leeds.",
    "The camping stove arrived without the pot support, one part is clearly missing from the box.",
    "Do the trekking poles fit into the side pockets of the Alpine 40L backpack?",
    "I would like a VAT receipt for my last order because I am buying the gear for my company.",
    "Your courier left the parcel in the rain and the cardboard was soaked through when I found it.",
    "When will the women's trail shoes in size 39 be back in stock? They have been sold out for weeks.",
    "I returned a pair of gloves three weeks ago and I still have not seen the money on my account.",
    "Please delete my account and all the data you keep about me, I no longer shop with you.",
    "The headlamp stops working after ten minutes even with new batteries, it is only two months old.",
    "I just wanted to say that your support team was very kind when my order got lost last year.",
    "Can you add a second pair of wool socks to my order? It has not been dispatched yet.",
    "How much does the Summit 65 pack weigh without the rain cover and the hip belt pockets?",
    "The invoice shows the wrong company name, could you send a corrected one to my email address?",
    "I paid with a gift card and a credit card, but the gift card balance was not used at all.",
    "The sleeping mat loses air overnight, I think the valve is faulty, I have used it twice.",
    "My order number is NW-58213 and the status has been processing for six days now.",
    "I would like to exchange the blue fleece for the green one, is there a return label in the box?",
    "Could you stop sending me the newsletter? I unsubscribed twice and it still comes every week.",
    "The tent pole snapped on our second trip when the wind picked up, can you send a replacement?",
    "Is the merino base layer itchy? My son has sensitive skin and reacts to most wool.",
    "Why was I charged for shipping when my basket was over the free delivery threshold?",
    "The parcel tracking says delivered but nothing is at my door and my neighbours have not seen it.",
    "Your website crashed while I was paying and now I do not know whether the order went through.",
    "Can I pick up the order at your Manchester store instead of having it delivered to my flat?",
    "The gaiters I received are a different model from the ones shown in the photos on your site.",
    "I love the new recycled fleece range, it would be great to have it in more colours as well.",
    "Could the repair of my jacket be done before the end of the month? I am travelling in June.",
    "Please send the refund to my bank account instead of the card, the card has expired since.",
    "Does the water filter remove viruses, or only bacteria and protozoa from stream water?",
)

QUESTION_FORMS = (
    "When does the flight to {dest} leave, and from which gate?",
    "Which airline flies to {dest}, and what is the lowest fare?",
    "Is the flight to {dest} on time?",
    "What aircraft flies to {dest}, and from which terminal?",
    "Is a checked bag included on the flight to {dest}?",
    "At what local time does the flight to {dest} arrive?",
    "How much would a checked bag cost on the flight to {dest} if I add it at the airport?",
    "When does the gate close for the flight to {dest}?",
)

FALLBACK_DESTINATIONS = ("Paris", "Madrid", "London", "Porto", "Rome", "Zurich")


def destinations(document: str) -> tuple[str, ...]:
    """The destination column of a markdown departures table (falls back to a fixed list)."""
    found = []
    for line in document.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and line.lstrip().startswith("|") and not re.fullmatch(r"-*", cells[0]) \
                and cells[2] and cells[2].lower() != "destination":
            found.append(cells[2])
    return tuple(dict.fromkeys(found)) or FALLBACK_DESTINATIONS


# asks for a flight's row as a record (the doc_records workload; its schema names the fields)
RECORD_FORMS = (
    "Give the table's row of the flight to {dest} as a JSON record.",
    "Write the departure to {dest} as a JSON record.",
    "As a JSON record: the board's entry for the flight to {dest}.",
    "Fill in the JSON record of the flight to {dest} from the table.",
    "Return the flight to {dest} as JSON.",
    "What does the board say about the flight to {dest}? Answer with a JSON record.",
)


def question(index: int, dests: tuple[str, ...], forms: tuple[str, ...] = QUESTION_FORMS) -> str:
    """Question `index`: every (form, destination) pair once before any repeats."""
    form = forms[index % len(forms)]
    return form.format(dest=dests[(index // len(forms)) % len(dests)])


def sentences(seed: str) -> Iterator[str]:
    """An endless, seeded stream of customer sentences (a shuffled deck, reshuffled when used up)."""
    rng = random.Random(seed)
    while True:
        deck = list(CUSTOMER_SENTENCES)
        rng.shuffle(deck)
        yield from deck
