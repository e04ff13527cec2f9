"""Writes pipeline/data/sample_data/de_qa.jsonl: the project's own German QA pairs in the SYNTH schema.

Everything here is written by the project (facts stated in our own words, arithmetic generated,
short reading texts composed from templates), so the data ships under the project's license.
Deterministic: run it again and the file is byte-identical.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "pipeline" / "data" / "sample_data" / "de_qa.jsonl"

# (Land, Hauptstadt, Kontinent, Amtssprache)
COUNTRIES = [
    ("Deutschland", "Berlin", "Europa", "Deutsch"), ("Frankreich", "Paris", "Europa", "Französisch"),
    ("Italien", "Rom", "Europa", "Italienisch"), ("Spanien", "Madrid", "Europa", "Spanisch"),
    ("Portugal", "Lissabon", "Europa", "Portugiesisch"), ("Österreich", "Wien", "Europa", "Deutsch"),
    ("die Schweiz", "Bern", "Europa", "Deutsch, Französisch, Italienisch und Rätoromanisch"),
    ("Polen", "Warschau", "Europa", "Polnisch"), ("Tschechien", "Prag", "Europa", "Tschechisch"),
    ("Ungarn", "Budapest", "Europa", "Ungarisch"), ("Dänemark", "Kopenhagen", "Europa", "Dänisch"),
    ("Schweden", "Stockholm", "Europa", "Schwedisch"), ("Norwegen", "Oslo", "Europa", "Norwegisch"),
    ("Finnland", "Helsinki", "Europa", "Finnisch und Schwedisch"), ("Griechenland", "Athen", "Europa", "Griechisch"),
    ("die Niederlande", "Amsterdam", "Europa", "Niederländisch"), ("Belgien", "Brüssel", "Europa", "Niederländisch, Französisch und Deutsch"),
    ("Irland", "Dublin", "Europa", "Irisch und Englisch"), ("Island", "Reykjavík", "Europa", "Isländisch"),
    ("Kroatien", "Zagreb", "Europa", "Kroatisch"), ("Rumänien", "Bukarest", "Europa", "Rumänisch"),
    ("Bulgarien", "Sofia", "Europa", "Bulgarisch"), ("Japan", "Tokio", "Asien", "Japanisch"),
    ("China", "Peking", "Asien", "Chinesisch"), ("Indien", "Neu-Delhi", "Asien", "Hindi und Englisch"),
    ("Ägypten", "Kairo", "Afrika", "Arabisch"), ("Kenia", "Nairobi", "Afrika", "Swahili und Englisch"),
    ("Marokko", "Rabat", "Afrika", "Arabisch und Tamazight"), ("Kanada", "Ottawa", "Nordamerika", "Englisch und Französisch"),
    ("Mexiko", "Mexiko-Stadt", "Nordamerika", "Spanisch"), ("Brasilien", "Brasília", "Südamerika", "Portugiesisch"),
    ("Argentinien", "Buenos Aires", "Südamerika", "Spanisch"), ("Peru", "Lima", "Südamerika", "Spanisch"),
    ("Australien", "Canberra", "Australien und Ozeanien", "Englisch"), ("Neuseeland", "Wellington", "Australien und Ozeanien", "Englisch und Māori"),
]

# (Bundesland, Landeshauptstadt)
STATES = [
    ("Bayern", "München"), ("Baden-Württemberg", "Stuttgart"), ("Hessen", "Wiesbaden"),
    ("Niedersachsen", "Hannover"), ("Nordrhein-Westfalen", "Düsseldorf"), ("Rheinland-Pfalz", "Mainz"),
    ("Sachsen", "Dresden"), ("Sachsen-Anhalt", "Magdeburg"), ("Thüringen", "Erfurt"),
    ("Brandenburg", "Potsdam"), ("Mecklenburg-Vorpommern", "Schwerin"), ("Schleswig-Holstein", "Kiel"),
    ("das Saarland", "Saarbrücken"),
]

# (Frage, kurze Antwort, ausführliche Antwort)
FACTS = [
    ("Welcher Fluss fließt durch Köln?", "Der Rhein.", "Durch Köln fließt der Rhein, einer der längsten und wichtigsten Flüsse Mitteleuropas."),
    ("Welcher Fluss fließt durch Hamburg?", "Die Elbe.", "Durch Hamburg fließt die Elbe, die bei Cuxhaven in die Nordsee mündet."),
    ("Welcher Fluss fließt durch Wien?", "Die Donau.", "Wien liegt an der Donau, dem zweitlängsten Fluss Europas."),
    ("Wie heißt der höchste Berg Deutschlands?", "Die Zugspitze.", "Der höchste Berg Deutschlands ist die Zugspitze im Wettersteingebirge. Sie ist knapp 2962 Meter hoch."),
    ("Wie heißt der größte See Deutschlands, der vollständig in Deutschland liegt?", "Die Müritz.", "Die Müritz in Mecklenburg-Vorpommern ist der größte See, der vollständig in Deutschland liegt."),
    ("Wie viele Bundesländer hat Deutschland?", "Sechzehn.", "Deutschland hat sechzehn Bundesländer, darunter die drei Stadtstaaten Berlin, Hamburg und Bremen."),
    ("In welchem Jahr fiel die Berliner Mauer?", "1989.", "Die Berliner Mauer fiel am 9. November 1989. Ein Jahr später, 1990, wurde Deutschland wiedervereinigt."),
    ("Wer schrieb den Faust?", "Johann Wolfgang von Goethe.", "Den Faust schrieb Johann Wolfgang von Goethe. Der erste Teil erschien 1808, der zweite nach seinem Tod 1832."),
    ("Wer komponierte die Neunte Sinfonie mit der Ode an die Freude?", "Ludwig van Beethoven.", "Die Neunte Sinfonie mit dem Schlusschor über Schillers Ode an die Freude stammt von Ludwig van Beethoven."),
    ("Wer entwickelte die Relativitätstheorie?", "Albert Einstein.", "Die Relativitätstheorie wurde von Albert Einstein entwickelt: die spezielle 1905, die allgemeine 1915."),
    ("Wer erfand den Buchdruck mit beweglichen Lettern in Europa?", "Johannes Gutenberg.", "Johannes Gutenberg aus Mainz erfand um 1450 den Buchdruck mit beweglichen Metalllettern."),
    ("Was ist die chemische Formel von Wasser?", "H2O.", "Wasser hat die chemische Formel H2O: zwei Wasserstoffatome sind an ein Sauerstoffatom gebunden."),
    ("Bei wie vielen Grad Celsius siedet Wasser auf Meereshöhe?", "Bei 100 Grad Celsius.", "Auf Meereshöhe siedet Wasser bei 100 Grad Celsius. In großer Höhe ist der Luftdruck geringer, deshalb siedet es dort früher."),
    ("Wie viele Planeten hat unser Sonnensystem?", "Acht.", "Unser Sonnensystem hat acht Planeten: Merkur, Venus, Erde, Mars, Jupiter, Saturn, Uranus und Neptun."),
    ("Welcher Planet ist der größte im Sonnensystem?", "Jupiter.", "Der größte Planet des Sonnensystems ist Jupiter, ein Gasriese mit mehr als elffacher Erdgröße im Durchmesser."),
    ("Welcher Planet ist der Sonne am nächsten?", "Merkur.", "Merkur ist der Sonne am nächsten. Er umrundet sie in nur etwa 88 Tagen."),
    ("Wie viele Tage hat ein Schaltjahr?", "366 Tage.", "Ein Schaltjahr hat 366 Tage, weil der Februar dann einen zusätzlichen Tag, den 29. Februar, bekommt."),
    ("Wie viele Minuten hat eine Stunde?", "Sechzig.", "Eine Stunde hat sechzig Minuten, und jede Minute hat sechzig Sekunden."),
    ("Welches Gas atmen Pflanzen bei der Photosynthese ein?", "Kohlendioxid.", "Bei der Photosynthese nehmen Pflanzen Kohlendioxid auf und geben mit Hilfe von Licht Sauerstoff ab."),
    ("Was ist das größte Organ des Menschen?", "Die Haut.", "Das größte Organ des Menschen ist die Haut. Sie schützt den Körper und hilft, die Temperatur zu regeln."),
    ("Wie viele Knochen hat ein erwachsener Mensch ungefähr?", "Etwa 206.", "Ein erwachsener Mensch hat ungefähr 206 Knochen. Bei Neugeborenen sind es mehr, weil einige später zusammenwachsen."),
    ("Welches Tier ist das größte lebende Säugetier?", "Der Blauwal.", "Das größte lebende Säugetier ist der Blauwal. Er kann über 30 Meter lang werden."),
    ("Welche Farbe entsteht, wenn man Blau und Gelb mischt?", "Grün.", "Mischt man blaue und gelbe Farbe, entsteht Grün."),
    ("Wie heißt die Währung in Deutschland?", "Der Euro.", "In Deutschland bezahlt man seit 2002 mit dem Euro; davor war es die Deutsche Mark."),
    ("Welche Sprache spricht man in Brasilien?", "Portugiesisch.", "In Brasilien spricht man Portugiesisch, weil das Land früher eine portugiesische Kolonie war."),
    ("Welches Meer liegt im Norden Deutschlands, westlich von Dänemark?", "Die Nordsee.", "Westlich von Dänemark und im Nordwesten Deutschlands liegt die Nordsee."),
    ("Wie heißt das Meer im Nordosten Deutschlands?", "Die Ostsee.", "Im Nordosten grenzt Deutschland an die Ostsee, an der zum Beispiel Rostock und Kiel liegen."),
    ("Wie viele Seiten hat ein Würfel?", "Sechs.", "Ein Würfel hat sechs quadratische Seiten, acht Ecken und zwölf Kanten."),
    ("Wie viele Ecken hat ein Dreieck?", "Drei.", "Ein Dreieck hat drei Ecken und drei Seiten; seine Innenwinkel ergeben zusammen 180 Grad."),
    ("Was misst ein Thermometer?", "Die Temperatur.", "Ein Thermometer misst die Temperatur, zum Beispiel der Luft, des Wassers oder des Körpers."),
    ("Wer malte die Mona Lisa?", "Leonardo da Vinci.", "Die Mona Lisa wurde von Leonardo da Vinci zu Beginn des 16. Jahrhunderts gemalt."),
    ("Wie nennt man ein Jahrhundert in Jahren?", "Hundert Jahre.", "Ein Jahrhundert umfasst hundert Jahre, ein Jahrtausend tausend Jahre."),
    ("Welches Metall ist bei Zimmertemperatur flüssig?", "Quecksilber.", "Quecksilber ist das einzige Metall, das bei Zimmertemperatur flüssig ist."),
    ("Welcher Kontinent ist der größte?", "Asien.", "Asien ist der größte Kontinent, sowohl nach Fläche als auch nach Einwohnerzahl."),
    ("Wie heißt der längste Fluss Deutschlands innerhalb der Landesgrenzen?", "Der Rhein.", "Der Rhein hat den längsten Abschnitt innerhalb Deutschlands, gefolgt von Elbe und Donau."),
    ("Wie viele Spieler hat eine Fußballmannschaft auf dem Feld?", "Elf.", "Eine Fußballmannschaft spielt mit elf Spielern auf dem Feld, einer davon ist der Torwart."),
    ("Was ist die Hauptzutat von Sauerkraut?", "Weißkohl.", "Sauerkraut wird aus fein geschnittenem Weißkohl gemacht, der mit Salz milchsauer vergoren wird."),
    ("Wie heißt das bekannteste Volksfest in München?", "Das Oktoberfest.", "Das bekannteste Volksfest in München ist das Oktoberfest auf der Theresienwiese."),
    ("Welche Stadt ist für ihr Brandenburger Tor bekannt?", "Berlin.", "Das Brandenburger Tor steht in Berlin und ist ein Symbol der deutschen Einheit."),
    ("Wo steht der Kölner Dom?", "In Köln.", "Der Kölner Dom steht in Köln am Rhein. Sein Bau dauerte mit Unterbrechungen über 600 Jahre."),
]

NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Greta", "Hannes", "Ida", "Jonas", "Lea", "Max", "Mia", "Paul", "Sophie", "Tim"]
ITEMS = [("Äpfel", "Apfel"), ("Bücher", "Buch"), ("Stifte", "Stift"), ("Murmeln", "Murmel"), ("Brötchen", "Brötchen"), ("Karten", "Karte")]
TOWNS = ["Lindenau", "Birkenfeld", "Hohenwald", "Steinbach", "Rosental", "Mühlheim am See", "Eichstedt", "Grünau"]
TRADES = [("Bäckerei", "Brot und Brezeln"), ("Schreinerei", "Tische und Schränke"), ("Gärtnerei", "Blumen und Gemüsepflanzen"),
          ("Käserei", "Bergkäse"), ("Töpferei", "Tassen und Schalen"), ("Brauerei", "helles Bier")]
RIVERS = ["die Lauter", "die Wiese", "der Mühlbach", "die Schwarza", "die Ilm", "der Goldbach"]


def dativ(land: str) -> str:
    """"von die Schweiz" is wrong German: articles take the dative after von/in."""
    return {"die Schweiz": "der Schweiz", "die Niederlande": "den Niederlanden"}.get(land, land)


def zahl(n: int) -> str:
    words = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf", "zwölf"]
    return words[n] if n < len(words) else str(n)


def rows() -> list[dict]:
    rng = random.Random(20261130)
    out: list[dict] = []

    def add(exercise: str, query: str, answer: str, seed_text: str = "") -> None:
        out.append({
            "synth_id": f"sgde_{len(out):05d}", "language": "de", "exercise": exercise, "model": "synth-grpo-sample",
            "query": query, "query_seed_text": seed_text, "synthetic_answer": answer,
            "words": len(answer.split()),
        })

    for land, cap, kont, sprache in COUNTRIES:
        von = dativ(land)
        add("memorization", f"Was ist die Hauptstadt von {von}?", f"{cap}.")
        add("memorization", f"Nenne die Hauptstadt von {von} und den Kontinent, auf dem das Land liegt.",
            f"Die Hauptstadt von {von} ist {cap}. Das Land liegt in {kont}." if kont != "Australien und Ozeanien"
            else f"Die Hauptstadt von {von} ist {cap}. Das Land gehört zu {kont}.")
        add("memorization", f"Welche Amtssprache hat {land}?", f"In {von} ist {sprache} Amtssprache." if "und" not in sprache
            else f"{land[0].upper() + land[1:]} hat mehrere Amtssprachen: {sprache}.")
    for land, cap in STATES:
        add("memorization", f"Wie heißt die Landeshauptstadt von {land}?", f"{cap}.")
        add("memorization", f"In welchem Bundesland ist {cap} die Landeshauptstadt?",
            f"{cap} ist die Landeshauptstadt von {land}.")
    for q, short, long in FACTS:
        add("memorization", q, short)
        add("memorization", q.rstrip("?") + "? Erkläre kurz.", long)

    for _ in range(90):
        a, b = rng.randint(2, 40), rng.randint(2, 30)
        kind = rng.choice(["plus", "minus", "mal", "text", "teilen"])
        if kind == "plus":
            add("arithmetic", f"Was ist {a} plus {b}?", f"{a} plus {b} ist {a + b}.")
        elif kind == "minus":
            a, b = max(a, b), min(a, b)
            add("arithmetic", f"Wie viel ist {a} minus {b}?", f"{a + 0} minus {b} ergibt {a - b}.")
        elif kind == "mal":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            add("arithmetic", f"Berechne {a} mal {b}.", f"{a} mal {b} ist {a * b}.")
        elif kind == "teilen":
            b = rng.randint(2, 9)
            q = rng.randint(2, 12)
            add("arithmetic", f"Wie viel ist {b * q} geteilt durch {b}?", f"{b * q} geteilt durch {b} ist {q}.")
        else:
            n = rng.choice(NAMES)
            m = rng.choice([x for x in NAMES if x != n])
            pl, _ = rng.choice(ITEMS)
            a, b = rng.randint(3, 20), rng.randint(1, 9)
            give = rng.random() < 0.5
            if give and b < a:
                add("arithmetic", f"{n} hat {a} {pl} und gibt {m} {b} davon. Wie viele {pl} hat {n} noch?",
                    f"{n} hatte {a} {pl} und hat {b} abgegeben. {a} minus {b} ist {a - b}, also hat {n} noch {a - b} {pl}.")
            else:
                add("arithmetic", f"{n} hat {a} {pl} und bekommt von {m} noch {b} dazu. Wie viele {pl} hat {n} jetzt?",
                    f"{n} hatte {a} {pl} und bekommt {b} dazu. {a} plus {b} ist {a + b}, also hat {n} jetzt {a + b} {pl}.")

    for i in range(70):
        town = TOWNS[i % len(TOWNS)]
        trade, product = rng.choice(TRADES)
        river = rng.choice(RIVERS)
        year = rng.randint(1150, 1890)
        people = rng.randint(8, 95) * 100
        owner = rng.choice(NAMES)
        bridges = rng.randint(2, 7)
        text = (f"{town} ist eine kleine Stadt an {river.split()[0] == 'der' and 'dem ' + river.split()[1] or 'der ' + river.split()[1]}. "
                f"Sie wurde im Jahr {year} zum ersten Mal erwähnt und hat heute etwa {people} Einwohner. "
                f"Über den Fluss führen {zahl(bridges)} Brücken. Am Marktplatz betreibt {owner} eine {trade}, "
                f"die vor allem für {product} bekannt ist.")
        kind = i % 5
        if kind == 0:
            add("rag", f"Wann wurde {town} zum ersten Mal erwähnt?", f"Im Jahr {year}.", text)
        elif kind == 1:
            add("rag", f"Wie viele Einwohner hat {town} laut dem Text?", f"{town} hat heute etwa {people} Einwohner.", text)
        elif kind == 2:
            add("rag", f"Wer betreibt die {trade} am Marktplatz von {town}, und wofür ist sie bekannt?",
                f"Die {trade} gehört {owner}. Sie ist vor allem für {product} bekannt.", text)
        elif kind == 3:
            add("rag", f"An welchem Fluss liegt {town}, und wie viele Brücken führen darüber?",
                f"{town} liegt an {river.split()[0] == 'der' and 'dem ' + river.split()[1] or 'der ' + river.split()[1]}. "
                f"Über den Fluss führen {zahl(bridges)} Brücken.", text)
        else:
            add("rag", f"Fasse den Text über {town} in zwei Sätzen zusammen.",
                f"{town} ist eine kleine Stadt mit etwa {people} Einwohnern, die {year} zuerst erwähnt wurde. "
                f"Bekannt ist sie für die {trade} von {owner} am Marktplatz, die {product} herstellt.", text)
    return out


def main() -> None:
    data = rows()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as f:
        for row in data:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(data)} rows to {OUT}")


if __name__ == "__main__":
    main()
