"""Words for Codenames, written for artnb: board nouns and extra clue words.

`BOARD_WORDS` are 252 simple, concrete English nouns, none part of another (no "lock" beside "clock"), so
two words on a board are never near-duplicates that an operative could not tell apart. `CLUE_WORDS` are
categories and qualities ("metal", "sweet", "royal") that link several board words; with constrained decoding
a spymaster's clue is one of these or a board word that is not on the current board.
"""

BOARD_WORDS = """
anchor apple arrow bakery balloon banana bandage barrel basket battery beach bean bear bed bee bell bicycle
blanket boat bone book boot bottle bowl box bread brick bridge broom brush bucket butter button cabbage
cactus cake camel camera candle cannon canoe carpet carrot castle cat cave chain chair cheese cherry chess
chicken chimney church circus cliff clock cloud coat coffee coin comb compass cookie copper corn cotton cow
crab crown cup curtain desert diamond dice doctor dog doll dolphin donkey door dragon drum duck eagle egg
elephant engine envelope factory farm feather fence fire fish flag flute forest fork fountain fox frog
garden ghost giant glass glove goat gold grape guitar hammer harbor helmet honey hook horse hospital island
jacket jam jungle kettle king kite knife ladder lake lamp lemon letter lion lizard magnet map marble mask
match medal milk mirror monkey moon mountain mouse mud museum needle nest ocean octopus onion orange padlock
paint palace pan paper parrot peach pear pebble pencil penguin piano pillow pilot pipe pirate pizza planet
plate pocket potato prison puddle pumpkin puzzle queen rabbit radio ribbon ring river robot rocket rope rose
sailor salt sand saw school scissors shark sheep shell ship shoe silver skirt sled snake snow soap sock soup
spider spoon stamp star station statue storm sugar sun swan sword table teacher telescope tent thread tiger
toast tomato tooth torch tower tractor train tree truck trumpet tunnel turtle umbrella valley violin volcano
wagon wall watch water whale wheel whistle window wing wolf wool zebra
""".split()

CLUE_WORDS = """
ancient animal army baby bath bird black breakfast brown building circle city clothes cold dark drink fairy
family fear feast flower fly fruit game glue green heavy history holiday hot hunter ice insect jewel journey
kitchen light machine magic metal money music night noise party pet road round royal science sea sharp sky
sleep smell soft space sport stone story summer sweet swim tall taste tiny tool toy travel treasure
vegetable war weapon weather wet white wild winter wood yellow zoo
""".split()
