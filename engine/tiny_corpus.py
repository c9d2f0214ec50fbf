"""Training text for the ``tiny`` model's BPE tokenizer (original prose, written for meshd).

Changing this text changes the tiny tokenizer and therefore every tiny checkpoint: bump
``engine.tiny.TINY_VERSION`` when you do.
"""

from __future__ import annotations

CORPUS = """\
The mesh wakes before the sun. A small machine under a desk in the kitchen opens its ears on the local
network and asks, quietly, whether anyone else is awake. Another answers from the attic, where the old
laptop with the cracked hinge has been humming since Tuesday. They exchange names, check each other's
signatures, and agree that they belong to the same family of machines.

Every node keeps a short list of its neighbours: who they are, how far away they feel, what they can
do. One of them holds a model with sixty-four experts; another keeps only a handful of those experts
and lends them out when asked. When a question arrives, the nearest node that knows the answer takes
it, and the reply travels back along the same path, one token after another.

Tokens are small pieces of text. A word like "kitchen" may be one token, while a rarer word such as
"hinge" might be split into two or three. Numbers are often broken into digits: 2026, 4096, 1024,
3.14159, 0.5, 42. Punctuation gets its own pieces too: commas, full stops, question marks? and
exclamation marks! Quotes "like these" and 'these' and brackets (round) [square] {curly} appear in
code as much as in prose.

def greet(name: str) -> str:
    return f"hello, {name}!"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

The baker on the corner starts at four in the morning. Flour, water, salt and a little yeast; the
dough rests while the oven warms. By six the first loaves are cooling on the rack and the street smells
of crust and steam. People stop on their way to the station, buy a loaf, and carry it home under an
arm like a folded newspaper.

Rain came in from the west in the afternoon. It started as a fine mist that hardly wet the pavement,
then thickened into long grey curtains that hid the hills. The river rose by a hand's width, the gulls
went inland, and the cat decided that the windowsill was the best seat in the house.

A good message has a beginning, a middle and an end. The system says who is speaking and how; the user
asks; the assistant answers. Then the user asks again, perhaps more precisely, and the answer improves.
Short answers are often better than long ones, but a list of steps helps when the task has many parts:
first, read the question; second, find what is known; third, say what is not known; last, answer.

Questions people ask a small model: What time is it? How do I boil an egg? Can you write a poem about
the sea? Why is the sky blue? What is the capital of a country I have never visited? The tiny model
does not know any of these answers. It writes words that look like words, in an order that looks like
an order, and that is all it is for: testing the wiring, not the wisdom.

Numbers and units: 12 ms, 300 s, 64 KiB, 1.5 GB, 9336/udp, 9337/tcp, 127.0.0.1, ::1, 0600, 0x1f.
Dates and times: 2026-11-30T06:00:00Z, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Months: January, February, March, April, May, June, July, August, September, October, November,
December.

Other scripts and symbols also appear in real text, so a byte-level tokenizer must handle them:
Grüße aus München, café au lait, naïve façade, smørrebrød, Ærø, señor, jalapeño.
Здравствуйте, как дела? Всё хорошо, спасибо.
こんにちは、世界。今日はいい天気ですね。
你好，世界。网络中的每台机器都有自己的名字。
안녕하세요, 반갑습니다.
مرحبا بالعالم
Emoji: 🙂 🚀 🌧️ 🍞 👩‍💻 🇳🇱 ✨ — and a few arrows → ← ↑ ↓ and math ∑ ∞ ≈ ≠ ≤ ≥ π.

The lighthouse keeper wrote in her log every evening. Wind from the north-east, force five. Two ships
passed, one heading for the harbour, one out to sea. The lamp was cleaned and the lens polished. At
night the beam turned slowly, and each time it passed the window the room was bright for a moment and
then dark again, bright and dark, like a slow heartbeat.

When a machine leaves the mesh, the others notice. First they wonder, then they suspect, and at last
they agree that it is gone. If it comes back, it says so, with a newer version of its own record, and
the others believe it because the record is signed. Stale news is ignored; fresh news spreads, one
neighbour telling the next, until everyone knows.

The garden in spring: peas climbing the strings, lettuce in rows, a few tulips the previous owner
planted, and a blackbird that sings from the chimney every evening at the same time. Weeds grow faster
than anything else. Water in the morning, not at noon. Tomatoes need sun, patience and a stick to lean
on.

user: Tell me a story about a robot who learns to cook.
assistant: Once there was a robot named Pell who lived above a bakery. Every morning it watched the
baker through a crack in the floor. One day the baker fell ill, and Pell came down the stairs, put on
an apron that was far too small, and made the bread by itself. It was not very good bread. But the
people of the street bought every loaf, because they had never seen a robot in an apron before.
user: Thank you! That was lovely.
assistant: You are welcome. Would you like another one?
"""
