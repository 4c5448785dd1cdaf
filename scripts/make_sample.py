"""Build scripts/data/sample.jsonl, the bundled sample of real text for the demo and benchmarks.

Why real text: token counts, padding and truncation only behave realistically on
prose with natural sentence and paragraph lengths, not on random words. Every
passage below was written for tokenq (nothing is copied from elsewhere), in
English and Chinese, on science, history, geography, cooking and computing,
plus search queries and reviews.

Why a script: about 110 originals are turned into about 300 lines of mixed
length by joining consecutive paragraphs of a topic into long passages and
cutting paragraphs into windows of one to three sentences. The choice is
seeded, so the output is byte-for-byte reproducible; the JSONL is committed
and ``--check`` verifies it is current.

    python scripts/make_sample.py          # rewrite scripts/data/sample.jsonl
    python scripts/make_sample.py --check  # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "sample.jsonl"
SEED = 20_240_611
EN_SNIPPETS = 91
"""Sentence windows cut from English paragraphs (brings English to 200 lines)."""
ZH_SNIPPETS = 45
"""Sentence windows cut from Chinese paragraphs (brings Chinese to 100 lines)."""
EN_FULL_TOPICS = ("photosynthesis", "printing", "silkroad", "vaccines")
ZH_FULL_TOPICS = ("yangtze", "embeddings")
"""Topics also emitted whole (four paragraphs): the longest inputs, past 512 tokens."""

# Encyclopedic paragraphs, four per topic; wrapped lines join with a space.
EN_TOPICS = """
## photosynthesis
Photosynthesis is the process by which plants, algae and some bacteria turn light into
chemical energy. Inside the chloroplasts of a leaf, the green pigment chlorophyll absorbs
mostly red and blue light and reflects green, which is why most foliage looks green to us.
The energy captured this way is used to split water molecules, releasing oxygen as a
by-product, and to build energy-carrying molecules called ATP and NADPH. Those molecules
then power a second set of reactions that take carbon dioxide from the air and fix it into
sugars. Almost every food chain on land and in the sunlit ocean starts with this conversion,
and the oxygen in the atmosphere we breathe was accumulated by photosynthetic organisms over
billions of years.

Biologists usually divide photosynthesis into two stages. The light-dependent reactions take
place in the thylakoid membranes, stacks of flattened sacs inside the chloroplast. There,
two protein complexes known as photosystem II and photosystem I pass electrons along a
chain, pumping protons across the membrane; the flow of those protons back through an enzyme
called ATP synthase drives the production of ATP. The second stage, often called the Calvin
cycle, happens in the fluid surrounding the thylakoids. It does not need light directly, but
it depends on the ATP and NADPH made in the first stage. Its central enzyme, RuBisCO,
attaches carbon dioxide to a five-carbon sugar, and it is thought to be the most abundant
protein on Earth.

RuBisCO has a weakness: it sometimes grabs oxygen instead of carbon dioxide, starting a
wasteful process called photorespiration. The problem gets worse in hot, dry weather, when
plants close the pores in their leaves to save water and oxygen builds up inside. Some
plants have evolved workarounds. Maize, sugarcane and many tropical grasses use the C4
pathway, which first captures carbon dioxide in a four-carbon compound and concentrates it
around RuBisCO in specialised cells. Cacti, pineapples and other desert plants use CAM
photosynthesis, opening their pores only at night and storing carbon dioxide as an acid
until the sun comes up. These strategies let them thrive in conditions where ordinary plants
struggle.

Because photosynthesis feeds so much of the planet, researchers have long wondered whether
it could be improved. A typical crop converts only one or two percent of the sunlight that
falls on it into stored chemical energy over a growing season. Some groups are trying to
engineer faster recovery from bright light, so that leaves do not keep their protective
mechanisms switched on for minutes after a cloud passes. Others hope to move the C4 pathway
into rice, which currently uses the less efficient C3 route. Outside biology, chemists study
artificial photosynthesis, using catalysts and semiconductors to split water or reduce
carbon dioxide with sunlight, with the aim of producing fuels without drawing on fossil
reserves.

## printing
Before the printing press reached Europe, books were copied by hand, usually by scribes
working in monasteries or, later, in commercial workshops in university towns. A single
Bible could take a skilled copyist more than a year, and errors crept in with every new
copy. Paper had arrived from the Islamic world by way of Spain and Italy, and woodblock
printing was already used for playing cards and religious images, but carving a whole book
into wood was slow and the blocks wore out. Meanwhile the demand for texts was growing as
literacy spread among merchants and city dwellers, and that demand set the stage for a
faster method.

Around 1450 in Mainz, Johannes Gutenberg combined several existing ideas into a working
system. He used a hand mould to cast individual letters from an alloy of lead, tin and
antimony, so that thousands of identical pieces of type could be made quickly. He developed
an oil-based ink that stuck to metal better than the water-based inks used for woodblocks,
and he adapted the screw press that was already familiar from wine and olive oil production.
The famous Gutenberg Bible, finished around 1455, was printed in about 180 copies, some on
paper and some on vellum. Movable type itself was not new; it had been used in China and
Korea centuries earlier, but Gutenberg's combination proved especially well suited to
alphabetic scripts.

The new technology spread with remarkable speed. By 1500, presses were operating in more
than two hundred European towns, and historians estimate that millions of volumes had been
printed. Venice became a major centre, where the printer Aldus Manutius popularised small,
portable editions of classical authors and helped introduce italic type. Prices fell, and
books that had once belonged only to wealthy institutions began to appear in private homes.
Printers also standardised spelling and page layout, added title pages and page numbers, and
produced indexes that readers could rely on, because every copy of an edition now matched
every other.

The social consequences were large and not always predictable. Martin Luther's pamphlets in
the 1520s were among the first mass-market publications, and printed translations of the
Bible in local languages changed religious life across northern Europe. Scientists could
share precise diagrams and tables of observations, so errors were easier to catch and
results easier to build on. Governments and churches responded with licensing systems and
lists of banned books, an early form of censorship aimed at a medium that moved faster than
any authority could read. Some historians compare the period to the arrival of the internet:
a sudden drop in the cost of copying information that reshaped who could speak and who could
listen.

## deltas
A river delta forms where a river slows down as it enters a larger, calmer body of water
such as a sea or a lake. As the current loses speed, it can no longer carry all of the sand,
silt and clay it picked up upstream, so the sediment settles out, the coarsest grains first.
Over the years the deposits build up into new land that pushes outward from the coast. The
river splits into smaller channels called distributaries, which wander across this low
ground and create the fan or triangle shape that gave deltas their name, after the Greek
letter that the ancient historian Herodotus saw in the mouth of the Nile.

Geographers often classify deltas by the force that shapes them most. River-dominated
deltas, such as the Mississippi's, grow long fingers of land called bird's-foot lobes
because waves and tides are too weak to spread the sediment evenly. Wave-dominated deltas,
like that of the São Francisco in Brazil, have smooth, curved shorelines where waves push
sand along the coast. Tide-dominated deltas, including the Ganges–Brahmaputra delta shared
by India and Bangladesh, are cut by many channels that run in and out with the tides,
separated by islands and mangrove forests. Most real deltas mix these influences, and their
shape can change from one century to the next.

Deltas are among the most fertile and densely populated places on Earth. Regular floods
spread fresh nutrients over the fields, and the flat land is easy to irrigate, which is why
some of the earliest civilisations grew up along the Nile and the rivers of Mesopotamia.
Today the Pearl River delta in southern China and the Mekong delta in Vietnam support tens
of millions of people, vast rice paddies, fish farms and some of the busiest ports in the
world. The wetlands at the edges of deltas also act as nurseries for fish and shellfish and
as resting grounds for migrating birds.

Many deltas are now shrinking. Dams upstream trap the sediment that once rebuilt the land,
while the extraction of groundwater, oil and gas causes the soft ground to compact and sink.
At the same time, sea levels are rising. In Louisiana, the coast has lost an area of land
roughly the size of Delaware since the 1930s. Engineers are experimenting with controlled
diversions that let muddy river water flow back into the marshes, and several countries are
restoring mangroves to hold the soil together. Protecting a delta means managing a whole
river basin, not just the coast.

## sourdough
Sourdough bread is leavened by a culture of wild yeasts and lactic acid bacteria rather than
by packaged baker's yeast. The culture, usually called a starter, is nothing more than flour
and water that has been left to ferment and then fed regularly with fresh flour. Within a
week or so, the microbes that happen to be present in the flour and the kitchen settle into
a stable community. The yeasts produce carbon dioxide that makes the dough rise, while the
bacteria produce lactic and acetic acids that give the bread its tang and help it keep
longer without going stale.

A basic loaf needs only flour, water, salt and a spoonful or two of active starter. Many
home bakers begin by mixing the flour and water and letting them rest for half an hour, a
step called autolyse, which lets the flour absorb the water and the gluten begin to develop
on its own. After the starter and salt are added, the dough goes through a bulk fermentation
of several hours at room temperature. Instead of kneading, bakers often perform a few sets
of stretches and folds during the first two hours, lifting one side of the dough and folding
it over the rest to build strength.

Knowing when bulk fermentation is finished is the hardest part for beginners. Recipes give
times, but the real answer depends on the temperature of the kitchen and the strength of the
starter. Look for a dough that has grown by about half, feels airy and slightly domed, and
shows bubbles along the sides of a clear container. The dough is then shaped into a tight
round or oval, placed in a floured basket and often left in the refrigerator overnight. The
cold slows the yeasts more than the bacteria, which deepens the flavour and makes the loaf
easier to score the next morning.

For baking, many people use a heavy cast-iron pot with a lid, preheated in a very hot oven.
The lid traps the steam released by the dough during the first twenty minutes, keeping the
surface soft so the loaf can expand fully, a burst known as oven spring. Removing the lid
for the rest of the bake lets the crust dry out, darken and crackle. A properly baked loaf
sounds hollow when tapped on the bottom and reaches an internal temperature of around 96
degrees Celsius. It is worth waiting at least an hour before cutting it, because the crumb
is still setting as it cools.

## hashing
A hash table is a data structure that stores pairs of keys and values and can find the value
for a key in roughly constant time, no matter how many entries it holds. It does this by
running each key through a hash function, which turns the key into a number, and using that
number to pick a slot in an array. When you look the key up later, the same function leads
you straight back to the same slot. Dictionaries in Python, objects in JavaScript and maps
in Go are all built on this idea, which makes it one of the most widely used structures in
everyday programming.

Because there are usually far more possible keys than slots, two different keys will
sometimes land in the same place. This is called a collision, and every hash table needs a
plan for it. In separate chaining, each slot holds a small list, and colliding entries are
simply appended to it. In open addressing, the table stores entries directly in the array
and, when a slot is taken, probes other slots in a fixed order until it finds a free one.
Linear probing checks the next slot, then the one after that; it is simple and friendly to
processor caches, but long runs of occupied slots can build up and slow lookups down.

The ratio of stored entries to available slots is called the load factor. As it rises,
collisions become more frequent and operations get slower, so most implementations grow the
table once the load factor crosses a threshold, often somewhere between one half and three
quarters. Growing means allocating a larger array, commonly twice the size, and reinserting
every entry, because each key's slot depends on the size of the array. A single resize is
expensive, but since it happens rarely and the table doubles each time, the average cost per
insertion stays constant, a property known as amortised constant time.

The choice of hash function matters more than it might seem. A good function spreads keys
evenly across the table, so that similar keys such as user1 and user2 do not pile up in
neighbouring slots. For programs that accept keys from the outside world, there is also a
security concern: an attacker who knows the function can craft many keys that collide,
turning fast lookups into slow ones and overloading a server. To defend against this,
languages such as Python and Rust use keyed hash functions like SipHash, seeded with a
random value each time the program starts, so that collisions cannot be predicted in
advance.

## volcanoes
A volcano is an opening in a planet's crust through which molten rock, gas and ash escape
from below. On Earth, most volcanoes sit along the edges of tectonic plates. Where two
plates pull apart, as along the Mid-Atlantic Ridge, rock from the mantle rises and melts as
the pressure on it drops. Where one plate slides beneath another, as around much of the
Pacific Ocean, water carried down with the sinking plate lowers the melting point of the
rock above it, producing magma that works its way to the surface. The chain of volcanoes
that encircles the Pacific is often called the Ring of Fire.

Not all volcanoes erupt in the same way. The runny basalt lava of Kilauea in Hawaii holds
little gas and flows in glowing rivers that can travel many kilometres, building broad,
gently sloping shield volcanoes. Magma richer in silica, like that beneath Mount Saint
Helens or Mount Pinatubo, is thick and sticky, so gas cannot escape easily. Pressure builds
until the magma shatters in an explosive eruption that hurls ash high into the atmosphere.
Between these extremes are stratovolcanoes such as Mount Fuji, tall cones built from
alternating layers of lava and ash over many eruptions.

The most dangerous part of an explosive eruption is often not the lava but the pyroclastic
flow, a fast-moving avalanche of hot gas, ash and rock that races down the slopes at more
than a hundred kilometres an hour. Pyroclastic flows buried the Roman towns of Pompeii and
Herculaneum when Vesuvius erupted in the year 79. Mudflows called lahars are another threat:
when ash mixes with rain or melted snow, it forms a slurry like wet concrete that can follow
river valleys far from the volcano. In 1985 a lahar from Nevado del Ruiz in Colombia
destroyed the town of Armero and killed more than twenty thousand people.

Large eruptions can affect the climate of the whole planet. When Mount Pinatubo in the
Philippines erupted in 1991, it injected millions of tonnes of sulfur dioxide into the
stratosphere, where it formed tiny droplets that reflected sunlight. Average global
temperatures fell by about half a degree Celsius over the following year. The eruption of
Tambora in Indonesia in 1815 was even larger, and 1816 became known in Europe and North
America as the year without a summer, with snow in June and widespread crop failures.
Volcanologists now monitor earthquakes, ground swelling and gas emissions to give warning
before eruptions like these.

## silkroad
The Silk Road was not a single road but a web of overland trade routes that linked China
with Central Asia, Persia, the Middle East and the Mediterranean for more than fifteen
centuries. The name was coined in the nineteenth century by the German geographer Ferdinand
von Richthofen, after the Chinese silk that was among its most famous goods. Few merchants
travelled the whole distance. Instead, goods passed from hand to hand through a chain of
markets and oasis towns such as Dunhuang, Samarkand and Merv, gaining value at every step. A
caravan might cover only thirty or forty kilometres on a good day, so a single stretch of
the journey could take months.

Silk flowed west, but it was only part of the story. Caravans carried spices, tea,
porcelain, paper, glassware, horses, furs, precious metals and gemstones in every direction.
Bactrian camels, which can survive on little water and tolerate both desert heat and
mountain cold, were the preferred pack animals on the hardest stretches. Along the way,
travellers stopped at caravanserais, walled inns built around a courtyard where people and
animals could rest safely for the night. Many cities on the route grew rich from taxes and
trade, and their bazaars became meeting places for dozens of languages. Goods that survived
the journey could sell for many times their original price.

Ideas travelled along the same paths as goods. Buddhism spread from India into Central Asia
and China, leaving behind cave temples filled with painted murals and statues. Later, Islam
spread eastward along the routes, and Nestorian Christians, Manichaeans and Zoroastrians
also built communities far from home. Technologies moved too: papermaking reached the
Islamic world from China by the eighth century and later found its way to Europe. Diseases
travelled as well, and many historians believe the Black Death reached the Mediterranean in
the 1340s partly through trade networks that connected the steppe with ports on the Black
Sea.

The overland routes declined after the fifteenth century for several reasons. The breakup of
the Mongol Empire made travel across Central Asia less safe, and European sailors found sea
routes around Africa to India and China that could carry far larger cargoes at lower cost.
Still, the Silk Road left deep marks on the cultures it connected, from the foods people eat
to the instruments they play. In recent times, archaeologists have studied tens of thousands
of manuscripts in many languages recovered from sites such as the library cave at Dunhuang,
which give a vivid picture of the contracts, letters and daily lives of ordinary travellers.

## vaccines
A vaccine trains the immune system to recognise a germ without the person having to suffer
the disease first. It presents the body with a harmless version or piece of the pathogen,
such as an inactivated virus, a weakened live strain, a purified protein, or genetic
instructions for making one protein. The immune system responds as if it had met a real
infection: it produces antibodies that can latch onto the invader and creates memory cells
that persist for months or years. If the real germ appears later, those memory cells
recognise it and mount a fast, strong response.

The first vaccine came from an observation about cowpox. In 1796 the English physician
Edward Jenner inoculated a boy with material from a cowpox sore and later showed that the
boy did not develop smallpox when exposed to it. Jenner had noticed that milkmaids who
caught cowpox seemed to be spared during smallpox outbreaks. The word vaccine comes from
vacca, the Latin word for cow. Nearly a century later, Louis Pasteur developed vaccines
against chicken cholera and rabies, and showed that germs could be deliberately weakened in
the laboratory. Smallpox, which killed hundreds of millions of people in the twentieth
century alone, was declared eradicated in 1980 after a worldwide vaccination campaign.

Vaccines protect not only the people who receive them but also those around them. When
enough people in a community are immune, a pathogen cannot find enough new hosts to keep
spreading, so outbreaks die out. This effect, called herd immunity, shields newborns who are
too young to be vaccinated and people whose immune systems are weakened by illness or
treatment. The share of the population that needs to be immune depends on how contagious the
disease is. Measles, one of the most contagious diseases known, requires around ninety-five
percent coverage to prevent outbreaks. When coverage falls below that level, even for a few
years, the disease can return quickly.

Messenger RNA vaccines represent one of the newest approaches. Instead of delivering a
protein, they deliver a short strand of RNA wrapped in a tiny droplet of fat. Cells read the
instructions and produce a harmless protein from the pathogen, such as the spike protein of
a coronavirus, which then triggers an immune response. The RNA breaks down within days and
never enters the cell nucleus where DNA is stored. Because the instructions can be rewritten
quickly, the platform allows new vaccines to be designed within weeks once a pathogen's
genetic sequence is known, although testing for safety and effectiveness still takes much
longer.

## tides
Tides are the regular rise and fall of sea level caused mainly by the gravitational pull of
the Moon. Gravity weakens with distance, so the Moon pulls more strongly on the side of the
Earth that faces it than on the Earth's centre, and more strongly on the centre than on the
far side. The result is a stretching force that raises two bulges of water, one facing the
Moon and one on the opposite side. As the Earth rotates under these bulges, most coastlines
experience two high tides and two low tides roughly every twenty-four hours and fifty
minutes.

The Sun also raises tides, but because it is so much farther away its effect is a little
less than half that of the Moon. When the Sun, Moon and Earth line up, at new moon and full
moon, their pulls combine and produce spring tides with a larger range between high and low
water. The name has nothing to do with the season. When the Sun and Moon are at right angles
to each other, at the first and third quarter, they partly cancel and produce neap tides
with a smaller range. This cycle repeats about every two weeks.

The actual height and timing of tides at any given place depend heavily on the shape of the
coastline and the sea floor. In the open ocean the tidal range is often less than a metre,
but funnel-shaped bays can amplify it dramatically. The Bay of Fundy in eastern Canada has
the highest tides in the world, with a difference of up to about sixteen metres between high
and low water. Some seas, such as the Mediterranean, have very small tides, while certain
places on the Gulf of Mexico see only one high tide a day. Tide tables are calculated from
long records of local observations rather than from first principles.

Tidal friction is slowly changing both the Earth and the Moon. As the oceans drag against
the sea floor, the Earth's rotation loses energy and the day grows longer, by roughly two
milliseconds per century. The angular momentum the Earth loses is transferred to the Moon,
which moves about 3.8 centimetres farther away each year, a figure measured by bouncing
lasers off reflectors left on the lunar surface by the Apollo astronauts. A similar process
long ago locked the Moon's rotation, so that it always shows the same face to the Earth.

## indexes
A relational database stores data in tables made of rows and columns, and answers questions
written in SQL. Without help, finding the rows that match a condition means reading every
row in the table, which is fine for a few thousand rows but painfully slow for hundreds of
millions. An index solves this the way the index at the back of a book does: it keeps a
sorted copy of one or more columns together with pointers to the matching rows, so the
database can jump to the right place instead of scanning everything. Choosing which columns
to index is one of the most important decisions in designing a database.

Most databases build their indexes as B-trees, balanced trees in which each node holds many
sorted keys and fits neatly into one page on disk. Because each node has hundreds of
children, even a table with a billion rows needs only four or five levels, so a lookup
touches only a handful of pages. B-trees support not only exact matches but also range
queries, such as all orders placed between two dates, and they can return rows already
sorted, which lets the database skip a separate sorting step. Many systems also offer hash
indexes for equality lookups and specialised indexes for text search or geographic data.

Indexes are not free. Every time a row is inserted, updated or deleted, each index on the
table must be updated too, so a table with many indexes writes more slowly. Indexes also
take up disk space and memory. A common mistake is to create an index on every column just
in case; a better approach is to look at the queries the application actually runs. The
query planner can show, through a command usually called EXPLAIN, whether it intends to use
an index or scan the whole table, and how many rows it expects to read at each step.

Composite indexes cover several columns at once, and their column order matters. An index on
last name followed by first name can quickly find everyone named Garcia, or one particular
Maria Garcia, but it cannot help much with a search for everyone named Maria regardless of
surname, just as a phone book sorted by surname is no help for finding first names. A
covering index includes every column a query needs, so the database can answer entirely from
the index without visiting the table. Tuning indexes is often the cheapest way to make a
slow application fast again.
"""

# Search queries, one per line.
EN_QUERIES = """
how long does it take for a sourdough starter to become active
why is the sky blue during the day but red at sunset
best way to store fresh basil
difference between a virus and a bacterium
what is the capital of Australia
how do noise cancelling headphones work
python list comprehension vs for loop speed
symptoms of iron deficiency
when did the Berlin Wall fall
how many calories are in a boiled egg
can I use baking soda instead of baking powder
what causes the northern lights
how to fix a flat tire on a bicycle
tallest mountain in Africa
git undo last commit but keep changes
why do cats purr
is it safe to eat raw cookie dough
how does compound interest work
speed of light in a vacuum
train from Paris to Amsterdam travel time
how to remove a red wine stain from carpet
what is a token in natural language processing
who wrote One Hundred Years of Solitude
how deep is the Mariana Trench
explain the difference between RAM and storage
best water temperature to brew green tea
how do I know if my houseplant needs more light
what does a Redis stream consumer group do
why do onions make you cry
convert 180 degrees Celsius to Fahrenheit
"""

# Product and place reviews, separated by blank lines.
EN_REVIEWS = """
Bought this kettle three months ago and it still boils a full litre in under four minutes.
The lid hinge feels a bit flimsy, though.

The headphones sound great for the price, but the ear cushions started peeling after six
weeks. Customer service sent replacements without any fuss, so I'm keeping them.

Terrible fit. I ordered my usual size and the jacket was tight across the shoulders and too
long in the sleeves. Returned it.

This is the third cast-iron pan I've owned and by far the best. It came well seasoned, eggs
slid right off on the first morning, and it heats evenly on my induction hob. Heavy, of
course, but that's the point.

The book starts slowly, and I almost gave up after the first hundred pages, but the second
half is gripping and the ending made me want to reread the whole thing.

Battery life is nowhere near the advertised twelve hours. With the screen at half brightness
and Wi-Fi on I get about seven.

Five stars for the hotel staff, two for the room. The view over the harbour was lovely, but
the air conditioning rattled all night and the shower never got properly hot.

Simple, sturdy, does exactly what it says. The desk lamp has three colour temperatures and
the warm setting is easy on the eyes late at night.

I wanted to love this running shoe. It's light and the cushioning feels great for the first
few kilometres, but on longer runs my left heel blistered every time.

Our kids play with this wooden train set every single day. Two years in, nothing has broken,
and the pieces fit the older set we inherited from their cousins.

The app keeps logging me out and asking for two-factor codes, sometimes three times a day.
The features are good, but the experience is exhausting.

Delivery was two days late and the box was crushed, but the plates inside were packed so
well that none of them were chipped.

Good coffee grinder for filter and French press. It struggles to grind fine enough for
espresso, so if that's what you drink, look elsewhere.

The restaurant was loud and the wait for a table was almost an hour, but the dumplings were
outstanding and the staff stayed friendly despite how busy they were.

Not worth the upgrade from last year's model. The camera is marginally better in low light,
and that's about it.
"""

# 百科式段落，每个主题四段；折行处直接相连（不加空格）。
ZH_TOPICS = """
## yangtze
长江是中国最长的河流，全长约六千三百公里，仅次于非洲的尼罗河和南美洲的亚马孙河，位居
世界第三。它发源于青藏高原唐古拉山脉的各拉丹冬雪山一带，自西向东流经青海、西藏、四川
、云南、重庆、湖北、湖南、江西、安徽、江苏和上海等十一个省级行政区，最后在上海附近注
入东海。长江流域面积约一百八十万平方公里，约占中国陆地面积的五分之一，养育了全国约三
分之一的人口。

人们习惯把长江分为上游、中游和下游三段。从源头到湖北宜昌为上游，河道穿行于高山峡谷之
间，落差大、水流急，著名的长江三峡就位于这一段的末端。从宜昌到江西湖口为中游，江面变
宽，河道弯曲，两岸分布着洞庭湖、鄱阳湖等大型湖泊，对洪水起着调蓄作用。湖口以下为下游
，地势平坦，水流平缓，江面宽阔，形成了土地肥沃、河网密布的长江三角洲。

自古以来，长江就是中国东西运输的重要通道，被称为“黄金水道”。重庆、武汉、南京等城市
都因江而兴，发展成为重要的港口和工商业中心。长江流域气候温暖湿润，适合种植水稻，“湖
广熟，天下足”的说法反映了中游地区在明清时期作为全国粮仓的地位。长江下游的江南地区经
济和文化高度发达，苏州一带的丝绸、园林和评弹都闻名中外，历史上出过大批文人和学者。

二十世纪以来，长江上修建了许多大型水利工程，其中最著名的是三峡水利枢纽。三峡大坝位于
湖北宜昌三斗坪，坝体于二〇〇六年全线建成，所在的水电站是世界上装机容量最大的水电站，
在防洪、发电和航运方面都发挥着重要作用。与此同时，工程也带来了移民安置、泥沙淤积和生
态变化等问题。近年来，国家提出“共抓大保护、不搞大开发”，并实施长江十年禁渔，希望恢
复长江江豚等珍稀物种的生存环境。

## tea
茶起源于中国，至今已有数千年的饮用历史。相传神农尝百草时发现了茶的解毒作用，这虽然只
是传说，却反映了茶最初被当作药物使用的事实。到了唐代，饮茶之风在全国盛行，陆羽写成了
世界上第一部茶学专著《茶经》，系统地介绍了茶的起源、产地、采摘、制作和煮饮方法，因此
被后人尊称为“茶圣”。宋代流行点茶和斗茶，到了明代，散茶冲泡的方式逐渐普及，一直延续
到今天。

根据加工方法和发酵程度的不同，中国茶通常被分为六大类：绿茶、白茶、黄茶、乌龙茶、红茶
和黑茶。绿茶不经过发酵，保留了鲜叶的清香，代表品种有西湖龙井和碧螺春；乌龙茶属于半发
酵茶，香气浓郁，如福建的铁观音和武夷岩茶；红茶经过全发酵，汤色红亮，口感醇厚，祁门红
茶是其中的名品；云南的普洱熟茶则属于黑茶，经过后发酵，存放多年后滋味更加醇和，受到不
少人的喜爱。

泡茶看似简单，其实很有讲究。水温是关键之一：细嫩的绿茶适合用八十度左右的水冲泡，水太
烫会把茶叶烫熟，使茶汤发苦；乌龙茶和红茶则需要接近沸腾的热水，才能充分释放香气。茶叶
与水的比例、浸泡时间以及茶具的材质也会影响口感。许多人喜欢用紫砂壶泡乌龙茶或普洱茶，
用透明的玻璃杯泡绿茶，以便欣赏茶叶在水中慢慢舒展的样子。

茶不仅是一种饮品，也深深融入了中国人的日常生活和社会交往。客人来访时奉上一杯热茶，是
最基本的待客之道；广东人喜欢“饮早茶”，一盅两件，边吃点心边聊天，可以坐上一个上午。
茶叶还通过古代的茶马古道和海上贸易传到世界各地，影响了日本的茶道、英国的下午茶以及中
亚和俄罗斯的饮茶习惯。如今，中国仍然是世界上最大的茶叶生产国和消费国之一。

## embeddings
在自然语言处理中，计算机无法直接理解文字，需要先把文本转换成数字。早期的方法把每个词
看作一个孤立的符号，用一个很长的向量来表示，向量中只有一个位置为一，其余全部为零，这
种方法被称为独热编码。它的问题在于无法体现词与词之间的关系，比如“猫”和“狗”在意义
上比“猫”和“汽车”更接近，但在这种表示下，任意两个词之间的距离都完全相同，模型也就
很难从一个词学到的知识推广到另一个词。

词向量的出现改变了这一局面。研究者让模型在大量文本上学习，根据一个词经常出现在哪些词
的旁边来确定它的向量，于是意义相近的词在向量空间中也彼此靠近，甚至出现了“国王减去男
人加上女人约等于女王”这样有趣的规律。后来，基于 Transformer 结构的模型
能够同时考虑整句话的上下文，为同一个词在不同语境下生成不同的表示，例如“苹果”在“吃
苹果”和“苹果手机”中的含义就可以被区分开来。

文本嵌入模型会把一整句话或一段文字压缩成一个固定长度的向量，常见的维度有三百八十四、
七百六十八或一千零二十四。两个向量之间的余弦相似度越高，说明两段文字的语义越接近。借
助这一点，搜索系统可以根据用户问题的含义而不是字面上的关键词来查找相关文档，即使问题
和文档用的是不同的说法，也能找到正确的答案。推荐系统、问答系统和文本聚类也广泛使用这
种方法。

在实际部署时，嵌入模型通常运行在图形处理器上，而处理效率在很大程度上取决于如何组织批
次。如果把长度相差很大的句子放在同一批中，较短的句子就要被补齐到最长句子的长度，浪费
大量计算。因此，许多推理服务会按照词元数量而不是请求数量来组批，并尽量把长度相近的文
本放在一起，从而在不超出显存的前提下提高吞吐量。同时，服务还要保证最早到达的请求不会
一直被排在后面。

## dumplings
饺子是中国北方最具代表性的传统食物之一，尤其在春节期间，许多家庭会在除夕夜围坐在一起
包饺子、吃饺子，寓意辞旧迎新、团圆美满。因为饺子的形状像古代的元宝，人们也把它看作招
财进宝的象征。有的家庭还会在其中一个饺子里包进一枚洗净的硬币，谁吃到了，就预示着新的
一年好运连连。在北方的一些地方，冬至也有吃饺子的习俗，民间有“冬至不端饺子碗，冻掉耳
朵没人管”的说法。

包饺子首先要和面。把中筋面粉放进盆里，一边慢慢加入清水，一边用筷子搅拌成絮状，再用手
揉成光滑的面团，盖上湿布醒半个小时左右。醒好的面团更加柔软，擀皮时不容易回缩。接着把
面团搓成长条，切成大小均匀的小剂子，按扁后用擀面杖擀成中间稍厚、边缘稍薄的圆形面皮，
这样捏合的地方不会太厚，煮的时候中间也不容易破。

馅料的种类非常丰富，最常见的是猪肉白菜馅和猪肉韭菜馅。做肉馅时，可以分几次往肉末里加
入少量花椒水或葱姜水，并朝同一个方向用力搅拌，直到肉馅变得黏稠上劲，这样做出来的饺子
更加鲜嫩多汁。白菜剁碎后要先用盐腌一会儿，再挤掉多余的水分，否则馅料会出汤，包的时候
不好封口。素馅饺子则常用鸡蛋、韭菜、香菇、木耳和胡萝卜等，清淡爽口。

煮饺子也有小窍门。水烧开后下饺子，用勺背沿着锅边轻轻推动，防止饺子粘在锅底。等水再次
沸腾时，加入半碗凉水，这样反复两三次，饺子皮鼓起、馅料熟透就可以捞出了，北方人把这种
做法叫作“点水”。吃饺子时，蘸上用醋、酱油、蒜泥和辣椒油调成的料汁，再配一瓣生蒜，是
许多北方人心中最地道的吃法。吃不完的饺子第二天还可以煎成底部金黄酥脆的煎饺。

## blackholes
黑洞是宇宙中引力极强的天体，强到连光都无法从中逃逸。当一颗质量远大于太阳的恒星耗尽核
燃料后，它的核心无法再抵抗自身的引力，会迅速坍缩，外层物质则可能在超新星爆发中被抛向
太空；如果剩余核心的质量足够大，就会形成一个黑洞。黑洞的边界叫作事件视界，一旦物质或
光越过这条界线，就再也无法返回外面的世界，因此我们无法直接看到视界以内发生的事情。

虽然黑洞本身不发光，天文学家仍然可以通过它对周围环境的影响来发现它。当黑洞吞噬附近恒
星的气体时，这些气体会在落入之前形成高速旋转的吸积盘，因摩擦而被加热到数百万度，发出
强烈的X射线。此外，天文学家通过长期观察银河系中心附近几颗恒星的运动轨道，推算出那里
存在一个质量约为太阳四百万倍的超大质量黑洞，这项研究也获得了二〇二〇年的诺贝尔物理学
奖。

二〇一五年，美国的激光干涉引力波天文台首次直接探测到引力波，信号来自大约十三亿光年外
两个黑洞的合并，这一发现证实了爱因斯坦在一百年前根据广义相对论作出的预言，并获得了二
〇一七年的诺贝尔物理学奖。二〇一九年，事件视界望远镜合作组织发布了人类第一张黑洞照片
，照片中心是星系M87中的超大质量黑洞的阴影，周围环绕着一圈明亮的光环。

黑洞并不是永远不变的。英国物理学家霍金在一九七四年提出，由于量子效应，黑洞会以极其微
弱的方式向外辐射能量，这种辐射后来被称为霍金辐射。按照这一理论，黑洞会非常缓慢地损失
质量，最终可能完全蒸发。不过，对于恒星级黑洞来说，这个过程所需的时间远远超过宇宙目前
的年龄，而且辐射强度比宇宙背景辐射还要微弱得多，因此至今还没有被直接观测到。
"""

# 搜索问题，每行一条。
ZH_QUERIES = """
北京到上海的高铁需要多长时间
怎么判断西瓜熟没熟
感冒了可以喝咖啡吗
Python 如何读取 JSON 文件
红烧肉怎么做才不腻
世界上最深的湖是哪个
猫为什么喜欢晒太阳
如何提高睡眠质量
区块链是什么意思
手机电池不耐用怎么办
长城到底有多长
绿茶和红茶有什么区别
孩子几岁开始学游泳比较好
为什么天空是蓝色的
Redis 的过期键是怎么删除的
"""

# 商品和店铺评价，以空行分隔。
ZH_REVIEWS = """
这款保温杯外观简洁，保温效果也不错，早上装的热水到下午还是烫的。唯一的缺点是杯盖有点
紧，拧开需要用点力气。

快递很快，第二天就到了。衣服面料摸起来很舒服，但是洗了一次就有点缩水，建议买大一码。

餐厅环境很好，服务员也很热情。招牌的酸菜鱼味道正宗，鱼片很嫩，就是价格稍微有点贵，周
末还要排队。

用了两个星期的扫地机器人，清扫效果超出预期，能自动绕开家具和电线。不过噪音比较大，晚
上用会吵到邻居。

这本书的前半部分节奏有点慢，但后面的故事越来越精彩，一口气读完了。作者对人物心理的描
写非常细腻。

耳机音质一般，低音偏弱，降噪效果也没有宣传的那么好。考虑到价格，只能说勉强可以接受。

酒店位置很方便，走路五分钟就到地铁站。房间干净整洁，早餐种类丰富，下次来还会选择这里
。

买来给父母用的电饭煲，操作简单，煮出来的米饭软硬适中。就是说明书的字太小，老人看起来
有点吃力。
"""


def parse_paragraphs(block: str, joiner: str) -> list[str]:
    """Blank-line separated paragraphs; a paragraph's wrapped lines joined by ``joiner``."""
    return [joiner.join(chunk.splitlines()) for chunk in block.strip().split("\n\n")]


def parse_topics(block: str, joiner: str) -> dict[str, list[str]]:
    """``## name`` sections of paragraphs."""
    topics: dict[str, list[str]] = {}
    for section in block.strip().split("## ")[1:]:
        name, _, body = section.partition("\n")
        topics[name.strip()] = parse_paragraphs(body, joiner)
    return topics


def sentences(text: str, lang: str) -> list[str]:
    """Split a paragraph into sentences (good enough for this hand-written text)."""
    if lang == "zh":
        return [s for s in re.split(r"(?<=[。！？])", text) if s]
    return re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", text)


def snippets(paragraphs: list[str], lang: str, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct windows of 1-3 consecutive sentences, never a whole paragraph."""
    joiner = "" if lang == "zh" else " "
    candidates = []
    for paragraph in paragraphs:
        parts = sentences(paragraph, lang)
        for size in (1, 2, 3):
            for start in range(len(parts) - size + 1):
                if size < len(parts):
                    candidates.append(joiner.join(parts[start : start + size]))
    candidates = sorted(set(candidates))
    rng.shuffle(candidates)
    return candidates[:count]


def long_passages(topics: dict[str, list[str]], full: tuple[str, ...], joiner: str) -> list[str]:
    """Paragraphs 1-3 and 2-4 of every topic, and the whole of a few topics."""
    out = []
    for name, paragraphs in topics.items():
        out.append(joiner.join(paragraphs[:3]))
        out.append(joiner.join(paragraphs[1:]))
        if name in full:
            out.append(joiner.join(paragraphs))
    return out


def build() -> list[dict[str, str]]:
    """Every record, shuffled with a fixed seed and numbered."""
    rng = random.Random(SEED)
    records: list[tuple[str, str]] = []
    for lang, topics_block, queries, reviews, full, count, joiner in (
        ("en", EN_TOPICS, EN_QUERIES, EN_REVIEWS, EN_FULL_TOPICS, EN_SNIPPETS, " "),
        ("zh", ZH_TOPICS, ZH_QUERIES, ZH_REVIEWS, ZH_FULL_TOPICS, ZH_SNIPPETS, ""),
    ):
        topics = parse_topics(topics_block, joiner)
        paragraphs = [p for ps in topics.values() for p in ps]
        texts = (
            queries.strip().splitlines()
            + parse_paragraphs(reviews, joiner)
            + paragraphs
            + long_passages(topics, full, joiner)
            + snippets(paragraphs, lang, count, rng)
        )
        records.extend((lang, text) for text in texts)
    rng.shuffle(records)
    return [
        {"id": f"s{index:03d}", "lang": lang, "text": text}
        for index, (lang, text) in enumerate(records, start=1)
    ]


def check(records: list[dict[str, str]]) -> str:
    """Assert the mix the demo and benchmarks rely on; return a one-line summary."""
    en = [r["text"] for r in records if r["lang"] == "en"]
    zh = [r["text"] for r in records if r["lang"] == "zh"]
    long_en = sum(len(t.split()) > 300 for t in en)
    long_zh = sum(len(t) > 400 for t in zh)
    texts = [r["text"] for r in records]
    assert len(set(texts)) == len(texts), "duplicate texts"
    assert 280 <= len(records) <= 320, len(records)
    assert 0.6 <= len(en) / len(records) <= 0.72, (len(en), len(zh))
    assert long_en >= 20 and long_zh >= 10, (long_en, long_zh)
    assert min(len(t.split()) for t in en) <= 5, "no short English queries"
    return (
        f"{len(records)} lines: {len(en)} en ({long_en} over 300 words, "
        f"longest {max(len(t.split()) for t in en)} words), {len(zh)} zh "
        f"({long_zh} over 400 characters, longest {max(len(t) for t in zh)})"
    )


def render(records: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args(argv)
    records = build()
    summary = check(records)
    text = render(records)
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale; run python scripts/make_sample.py", file=sys.stderr)
            return 1
    else:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text, encoding="utf-8")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
