use std::io::Write;

use qerl_rl::data::*;
use qerl_rl::prompt::*;
use qerl_rl::reward::{math_equiv, parse_number, Gsm8kReward, Math500Reward, Reward};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.path().join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

#[test]
fn vendored_gsm8k() {
    let test = load_builtin(DatasetKind::Gsm8k, Split::Test).unwrap();
    assert_eq!(test.len(), 1319);
    assert_eq!(test[0].id, "0");
    assert_eq!(test[0].answer, "18");
    assert!(test[0].question.starts_with("Janet"));
    assert!(test[0].solution.ends_with("#### 18"));
    let train = load_builtin(DatasetKind::Gsm8k, Split::Train).unwrap();
    assert_eq!(train.len(), 7473);
    // Every reference is a number, and a model that copies the solution scores 1.
    let r = Gsm8kReward::strict();
    for ex in test.iter().chain(&train) {
        assert!(
            parse_number(&ex.answer).is_some(),
            "{}: {:?}",
            ex.id,
            ex.answer
        );
        assert_eq!(r.score(&ex.solution, &ex.answer).unwrap(), 1.0, "{}", ex.id);
    }
    // Thousands separators are stripped.
    assert!(train.iter().all(|e| !e.answer.contains(',')));
}

#[test]
fn vendored_math500() {
    let test = load_builtin(DatasetKind::Math500, Split::Test).unwrap();
    assert_eq!(test.len(), 500);
    assert_eq!(test[0].answer, "\\left( 3, \\frac{\\pi}{2} \\right)");
    assert_eq!(test[0].id, "test/precalculus/807.json");
    let r = Math500Reward::new();
    for ex in &test {
        let boxed = format!("so the answer is $\\boxed{{{}}}$.", ex.answer);
        assert_eq!(
            r.score(&boxed, &ex.answer).unwrap(),
            1.0,
            "{}: {}",
            ex.id,
            ex.answer
        );
    }
    // The worked solutions' own last box agrees with the `answer` field (a real-data check of
    // boxed extraction and normalisation).
    let text =
        std::fs::read_to_string(builtin_path(DatasetKind::Math500, Split::Test).unwrap()).unwrap();
    let mut agree = 0;
    let mut disagree = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (sol, ans) = (
            v["solution"].as_str().unwrap(),
            v["answer"].as_str().unwrap(),
        );
        if r.score(sol, ans).unwrap() == 1.0 {
            agree += 1;
        } else {
            disagree.push(format!(
                "{:?} vs {:?}",
                qerl_rl::reward::last_boxed(sol),
                ans
            ));
        }
    }
    assert!(
        agree == 500,
        "only {agree} of 500 solutions match their answers: {disagree:#?}"
    );
    assert!(!math_equiv("\\frac{1}{3}", &test[0].answer));
}

#[test]
fn custom_jsonl_fields() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        &dir,
        "mine.jsonl",
        "{\"q\": \"1+1?\", \"a\": 2, \"key\": \"x1\"}\n\n{\"q\": \"2+2?\", \"a\": \" 4 \", \"key\": 7}\n",
    );
    let spec = FieldSpec {
        question: "q".into(),
        answer: "a".into(),
        answer_format: AnswerFormat::Plain,
        id: Some("key".into()),
    };
    let ex = load_jsonl(&p, &spec).unwrap();
    assert_eq!(ex.len(), 2, "blank lines are skipped");
    assert_eq!((ex[0].id.as_str(), ex[0].answer.as_str()), ("x1", "2"));
    assert_eq!((ex[1].id.as_str(), ex[1].answer.as_str()), ("7", "4"));

    let boxed = write(
        &dir,
        "boxed.jsonl",
        "{\"problem\": \"p\", \"solution\": \"so $\\\\boxed{\\\\frac{1}{2}}$\"}\n",
    );
    let spec = FieldSpec {
        question: "problem".into(),
        answer: "solution".into(),
        answer_format: AnswerFormat::Boxed,
        id: None,
    };
    let ex = load_jsonl(&boxed, &spec).unwrap();
    assert_eq!(
        (ex[0].answer.as_str(), ex[0].id.as_str()),
        ("\\frac{1}{2}", "0")
    );
}

#[test]
fn errors_name_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let spec = FieldSpec::gsm8k();
    let p = write(
        &dir,
        "missing.jsonl",
        "{\"question\": \"q\", \"answer\": \"#### 1\", \"idx\": 0}\n{\"question\": \"q\"}\n",
    );
    let e = load_jsonl(&p, &spec).unwrap_err().to_string();
    assert!(
        e.contains("missing.jsonl:2") && e.contains("`answer`") && e.contains("question"),
        "{e}"
    );

    let p = write(
        &dir,
        "bad.jsonl",
        "{\"question\": \"q\", \"answer\": \"#### 1\", \"idx\": 0}\n{not json\n",
    );
    let e = load_jsonl(&p, &spec).unwrap_err();
    assert!(matches!(e, DataError::Json { line: 2, .. }), "{e}");

    let p = write(
        &dir,
        "type.jsonl",
        "{\"question\": [1], \"answer\": \"#### 1\"}\n",
    );
    let e = load_jsonl(&p, &spec).unwrap_err().to_string();
    assert!(
        e.contains("type.jsonl:1") && e.contains("`question`") && e.contains("an array"),
        "{e}"
    );

    let p = write(
        &dir,
        "nohash.jsonl",
        "{\"question\": \"q\", \"answer\": \"42\", \"idx\": 0}\n",
    );
    let e = load_jsonl(&p, &spec).unwrap_err().to_string();
    assert!(e.contains("nohash.jsonl:1") && e.contains("####"), "{e}");

    let p = write(&dir, "array.jsonl", "[1, 2]\n");
    assert!(matches!(
        load_jsonl(&p, &spec).unwrap_err(),
        DataError::NotObject { line: 1, .. }
    ));

    let p = write(&dir, "empty.jsonl", "\n\n");
    assert!(matches!(
        load_jsonl(&p, &spec).unwrap_err(),
        DataError::Empty { .. }
    ));

    let e = load_jsonl(&dir.path().join("nope.jsonl"), &spec)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.jsonl"), "{e}");
}

#[test]
fn dataset_arguments() {
    let jsonl = FieldSpec::for_kind(DatasetKind::Jsonl);
    let (k, p, f) = resolve_dataset("gsm8k", Split::Test, &jsonl).unwrap();
    assert_eq!(k, DatasetKind::Gsm8k);
    assert!(p.ends_with("gsm8k/test.jsonl"));
    assert_eq!(f, FieldSpec::gsm8k());
    let (k, _, f) = resolve_dataset("math500", Split::Test, &jsonl).unwrap();
    assert_eq!((k, f.question.as_str()), (DatasetKind::Math500, "problem"));
    let (k, p, _) = resolve_dataset("some/file.jsonl", Split::Test, &jsonl).unwrap();
    assert_eq!(
        (k, p.to_str().unwrap()),
        (DatasetKind::Jsonl, "some/file.jsonl")
    );
    assert!(resolve_dataset("imagenet", Split::Test, &jsonl).is_err());
}

#[test]
fn prompts() {
    let m = PromptTemplate::think_answer().render("What is 2+2?");
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].role, "system");
    assert!(m[0].content.contains("<think>") && m[0].content.contains("<answer>"));
    assert_eq!(m[1], ChatMessage::user("What is 2+2?"));
    let m = PromptTemplate::bare().render("Q");
    assert_eq!(m, vec![ChatMessage::user("Q")]);
    let t = PromptTemplate {
        system: None,
        user: "Question: {question}\nAnswer in \\boxed{}.".into(),
    };
    assert_eq!(
        t.render("Q")[0].content,
        "Question: Q\nAnswer in \\boxed{}."
    );
    let t = PromptTemplate {
        system: Some(String::new()),
        user: "Solve:".into(),
    };
    assert_eq!(t.render("Q"), vec![ChatMessage::user("Solve:\n\nQ")]);
    assert!(PromptTemplate::boxed().render("Q")[0]
        .content
        .contains("\\boxed"));
}
