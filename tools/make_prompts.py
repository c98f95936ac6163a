# ruff: noqa: E501  (Chinese data strings: ruff counts full-width characters as width 2)
"""Generate the shipped business prompt set (quantpipe/prompts/data/business_{calib,eval}.jsonl).

Reproducible: ``python tools/make_prompts.py`` with the fixed SEED rewrites both
files byte for byte. Prompts are composed from realistic building blocks (clauses, policy
sections, figures, documents) with varied company names, people, numbers and dates, in
English and Chinese. The split is stratified by (category, lang): 25% of every stratum is
held out for evaluation and never used for calibration. Schema: docs/prompts.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from string import Template

SEED = 20260101
EVAL_FRACTION = 0.25
# the shipped data lives in the prompts package; this generator is a tool, not part of it
HERE = Path(__file__).resolve().parent.parent / "quantpipe" / "prompts" / "data"

# how many prompts per category and language
COUNTS: dict[str, tuple[int, int]] = {  # category -> (en, zh)
    "customer_support": (26, 12),
    "contract_summary": (20, 8),
    "policy_summary": (16, 8),
    "finance_review": (20, 8),
    "hr": (20, 10),
    "product_description": (18, 10),
    "extraction": (26, 12),
    "sql": (20, 8),
    "code": (22, 8),
    "email": (22, 10),
    "multi_turn": (18, 10),
}

# ---------------------------------------------------------------------------------------
# slot pools

COMPANIES_EN = [
    "Northwind Logistics", "Brightline Health", "Apex Retail Group", "Meridian Capital Partners",
    "Harborview Software", "Cobalt Energy Solutions", "Summit Foods", "Bluewater Insurance",
    "Pioneer Manufacturing", "Lumen Analytics", "Granite Construction Services",
    "Silverleaf Hotels", "Evergreen Pharma", "Redwood Telecom", "Orion Aerospace Components",
    "Keystone Facilities", "Willow & Finch Design", "Atlas Freight Systems", "Crescent Bank",
    "Tidewater Marine Supply",
]
COMPANIES_ZH = [
    "华信科技有限公司", "上海远航物流有限公司", "深圳市明德电子有限公司", "杭州云启软件股份有限公司",
    "北京嘉禾医疗器械有限公司", "广州恒泰零售集团", "成都蓝海餐饮管理有限公司", "苏州精工制造有限公司",
    "南京瑞丰保险代理有限公司", "武汉光谷新能源科技有限公司", "天津港汇供应链管理有限公司",
    "厦门鹭岛酒店管理有限公司", "青岛海润食品有限公司", "西安博远教育科技有限公司",
]
PEOPLE_EN = [
    "Sarah Mitchell", "David Okafor", "Priya Raman", "James Whitaker", "Elena Rossi", "Tom Becker",
    "Aisha Khan", "Michael Chen", "Laura Gómez", "Robert Nguyen", "Hannah Schultz", "Kevin O'Brien",
    "Maria Santos", "Daniel Kim", "Olivia Brooks", "Samuel Adeyemi",
]
PEOPLE_ZH = [
    "张伟", "李娜", "王芳", "刘洋", "陈静", "杨磊", "赵敏", "黄晓东", "周婷", "吴刚", "徐丽华", "孙浩",
    "马俊", "朱晓燕", "胡建国", "郭晨",
]
CITIES_EN = ["Chicago", "Denver", "Austin", "Seattle", "Boston", "Atlanta", "Toronto", "London",
             "Dublin", "Singapore", "Rotterdam", "Phoenix"]
CITIES_ZH = ["上海", "北京", "深圳", "杭州", "广州", "成都", "苏州", "南京", "武汉", "西安", "重庆"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


class Slots:
    """Random slot values for one prompt (one rng per record keeps generation reproducible)."""

    def __init__(self, rng: random.Random, lang: str):
        self.rng = rng
        self.lang = lang

    def company(self) -> str:
        return self.rng.choice(COMPANIES_ZH if self.lang == "zh" else COMPANIES_EN)

    def two_companies(self) -> tuple[str, str]:
        pool = COMPANIES_ZH if self.lang == "zh" else COMPANIES_EN
        a, b = self.rng.sample(pool, 2)
        return a, b

    def person(self) -> str:
        return self.rng.choice(PEOPLE_ZH if self.lang == "zh" else PEOPLE_EN)

    def people(self, n: int) -> list[str]:
        return self.rng.sample(PEOPLE_ZH if self.lang == "zh" else PEOPLE_EN, n)

    def city(self) -> str:
        return self.rng.choice(CITIES_ZH if self.lang == "zh" else CITIES_EN)

    def date(self, year: int | None = None) -> str:
        y = year or self.rng.choice([2024, 2025, 2026])
        m, d = self.rng.randint(1, 12), self.rng.randint(1, 28)
        if self.lang == "zh":
            return f"{y}年{m}月{d}日"
        return f"{MONTHS[m - 1]} {d}, {y}"

    def money(self, lo: int, hi: int, step: int = 10) -> str:
        v = self.rng.randrange(lo, hi, step)
        return f"{v:,}元" if self.lang == "zh" else f"${v:,}"

    def num(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def order_no(self) -> str:
        return f"{self.rng.choice(['SO', 'ORD', 'PO', 'INV'])}-{self.rng.randint(100000, 999999)}"

    def pick(self, xs):
        return self.rng.choice(xs)


def fill(t: str, **kw) -> str:
    return Template(t).substitute(**kw)


# ---------------------------------------------------------------------------------------
# customer support

SUPPORT_ISSUES_EN = [
    "I ordered a standing desk on $date (order $order) and it still has not arrived. The "
    "tracking page has said 'label created' for nine days. I need it before my home office "
    "inspection next week. What is going on?",
    "I was charged twice for my monthly subscription ($amount each) on my credit card "
    "statement. Please refund the duplicate charge. My account email is "
    "$email.",
    "The blender I received (order $order) arrived with a cracked jar. I have photos. I "
    "would like a replacement, not a refund, because I use it every morning.",
    "Since your app update yesterday I cannot log in. It says 'session expired' right after "
    "I enter the code from my authenticator. I have reinstalled twice. I am on Android 14.",
    "I want to cancel my annual plan. I signed up on $date and was told I could cancel "
    "within 30 days for a full refund. Please confirm the cancellation and the refund amount.",
    "The invoice $order shows $amount but our purchase order was approved for a lower amount. "
    "Our accounts payable team cannot pay it until the difference is explained.",
    "My warranty claim for the espresso machine has been 'under review' for three weeks. "
    "The machine leaks from the bottom. I bought it on $date. Can someone actually look at it?",
    "We exported our customer data from your CRM but the CSV is missing the phone number and "
    "last contact date columns. We need a complete export for our audit by Friday.",
    "The shoes I ordered are a full size too small even though I followed your size chart. "
    "Can I exchange them for a larger size? The order number is $order.",
    "Your technician was supposed to come between 8 and 12 today and nobody showed up. I "
    "took a day off work for this. This is the second missed appointment.",
    "Our team's dashboards have been loading very slowly since Monday, sometimes taking over "
    "a minute. We are on the Business plan with about 40 users in $city.",
    "I received a package meant for someone else. It has my address but a different name "
    "on it. What should I do with it?",
]
SUPPORT_TASKS_EN = [
    "Write a reply to this customer email on behalf of $company support. Be empathetic, "
    "explain the next steps clearly and keep it under 150 words.",
    "Draft a response for our support agent. Apologize once, do not promise anything we "
    "cannot guarantee, and include a reference number placeholder.",
    "You are a customer service representative at $company. Respond to the customer below "
    "in a friendly, professional tone and offer a concrete resolution.",
    "Classify the urgency of this ticket (low/medium/high), name the team that should own "
    "it, and then write a short first reply to the customer.",
    "Reply to the customer. Our policy: refunds within 30 days of purchase, replacements "
    "ship within 2 business days, and goodwill credits up to $credit need no approval.",
]
SUPPORT_ISSUES_ZH = [
    "我在$date下单的空气净化器（订单号$order）到现在还没发货，客服电话一直打不通。"
    "请问什么时候能发货？如果本周内不能发货我要求退款。",
    "你们的会员自动续费扣了我$amount，我根本没有开通自动续费，请马上退款并关闭这个功能。",
    "收到的冰箱外壳有明显凹痕，快递员说签收后就不管了。我有开箱视频，希望换一台新的。",
    "APP升级以后一直闪退，打开就退出，手机是华为Mate 60，已经卸载重装过了还是不行。",
    "发票抬头开错了，应该是$company，现在财务不能报销，麻烦重新开一张增值税专用发票。",
    "预约的上门安装师傅迟到了三个小时，而且态度很差，安装完还多收了我200元材料费。",
    "我们公司在用你们的SaaS系统，从周一开始报表导出一直失败，提示“服务器繁忙”，影响月底结账。",
    "买的衣服洗了一次就严重缩水，明显是质量问题，订单号$order，要求退货退款。",
]
SUPPORT_TASKS_ZH = [
    "请以$company客服的身份回复下面这位客户，语气真诚，说明处理步骤和时效，不超过200字。",
    "请帮客服同事起草一段回复：先致歉，再给出解决方案，最后留下工单编号占位符。",
    "请判断这条工单的紧急程度（低/中/高），指出应由哪个部门处理，并写一段给客户的首次回复。",
    "根据公司政策回复客户：签收7天内无理由退货，质量问题15天内可换货，补偿券上限$credit。",
]


def gen_customer_support(s: Slots) -> dict:
    zh = s.lang == "zh"
    issue = s.pick(SUPPORT_ISSUES_ZH if zh else SUPPORT_ISSUES_EN)
    task = s.pick(SUPPORT_TASKS_ZH if zh else SUPPORT_TASKS_EN)
    name = s.person()
    kw = dict(date=s.date(), order=s.order_no(), amount=s.money(19, 400, 1), city=s.city(),
              company=s.company(), credit=s.money(20, 100, 5),
              email=f"{name.split()[0].lower()}@example.com" if not zh else "")
    body = fill(issue, **kw)
    head = fill(task, **kw)
    if zh:
        return {"prompt": f"{head}\n\n客户留言（{name}）：\n{body}"}
    return {"prompt": f"{head}\n\nCustomer message from {name}:\n\"{body}\""}


# ---------------------------------------------------------------------------------------
# contracts

CLAUSES_EN = [
    ("Services", "$b shall provide the software development, integration and maintenance "
     "services described in each Statement of Work (\"SOW\") executed under this Agreement. "
     "Each SOW shall specify the deliverables, milestones, acceptance criteria and the fees "
     "applicable to that engagement. In the event of a conflict between this Agreement and an "
     "SOW, this Agreement shall prevail unless the SOW expressly states otherwise."),
    ("Term", "This Agreement commences on $start and continues for an initial term of $term "
     "months. Thereafter it renews automatically for successive twelve-month periods unless "
     "either party gives written notice of non-renewal at least $notice days before the end "
     "of the then-current term."),
    ("Fees and Payment", "$a shall pay the fees set out in each SOW. $b shall invoice monthly "
     "in arrears. Invoices are payable within $payterm days of receipt. All fees are "
     "exclusive of VAT and sales taxes, which $a shall pay in addition at the applicable "
     "rate. The total fees under the initial SOW are estimated at $fee."),
    ("Late Payment", "Any amount not paid when due shall bear interest at $interest% per "
     "month from the due date until paid in full. If any undisputed invoice remains unpaid "
     "for more than 45 days, $b may suspend the Services on ten days' written notice until "
     "all overdue amounts are paid."),
    ("Confidentiality", "Each party shall keep confidential all information disclosed by the "
     "other party that is marked as confidential or would reasonably be understood to be "
     "confidential, and shall use it only to perform its obligations under this Agreement. "
     "These obligations survive for five years after termination, except for trade secrets, "
     "which shall be protected for as long as they remain trade secrets."),
    ("Intellectual Property", "Upon full payment of the applicable fees, all rights in the "
     "deliverables created specifically for $a vest in $a. $b retains ownership of its "
     "pre-existing tools, libraries and know-how and grants $a a perpetual, non-exclusive, "
     "royalty-free licence to use them as incorporated in the deliverables."),
    ("Warranties", "$b warrants that the Services will be performed with reasonable skill and "
     "care and that each deliverable will materially conform to its specification for "
     "$warranty days after acceptance. $a's sole remedy for breach of this warranty is the "
     "re-performance of the non-conforming Services at no additional charge."),
    ("Limitation of Liability", "Neither party shall be liable for any indirect, incidental "
     "or consequential loss, including loss of profit or data. Each party's total aggregate "
     "liability under this Agreement shall not exceed $cap times the fees paid in the twelve "
     "months preceding the claim, save that this cap does not apply to breach of "
     "confidentiality, fraud, or death or personal injury caused by negligence."),
    ("Indemnification", "$b shall indemnify $a against any third-party claim alleging that a "
     "deliverable infringes that third party's intellectual property rights, provided that $a "
     "notifies $b promptly, gives $b sole control of the defence and provides reasonable "
     "assistance at $b's expense."),
    ("Termination", "Either party may terminate this Agreement with immediate effect by "
     "written notice if the other party commits a material breach that is not remedied within "
     "$cure days of notice, or becomes insolvent. $a may terminate for convenience on $conv "
     "days' written notice, in which case it shall pay for Services performed up to the "
     "termination date and any non-cancellable commitments."),
    ("Data Protection", "Where $b processes personal data on behalf of $a, it shall do so only "
     "on documented instructions, implement appropriate technical and organisational "
     "measures, notify $a of any personal data breach within $breach hours, and delete or "
     "return all personal data at the end of the Services."),
    ("Service Levels", "$b shall maintain availability of the hosted components of at least "
     "$sla% per calendar month, excluding scheduled maintenance announced 48 hours in "
     "advance. For each 0.5% below the target, $a is entitled to a service credit of 5% of "
     "the monthly fees, up to a maximum of 25%."),
    ("Non-Solicitation", "During the term and for twelve months thereafter, neither party "
     "shall directly solicit for employment any employee of the other party who was involved "
     "in the Services, without the other party's prior written consent. General job "
     "advertisements do not breach this clause."),
    ("Force Majeure", "Neither party is liable for delay or failure caused by events beyond "
     "its reasonable control, including natural disasters, war, epidemics or failures of "
     "public utilities. If such an event lasts more than 60 days, either party may terminate "
     "the affected SOW on written notice."),
    ("Governing Law", "This Agreement is governed by the laws of $law. The parties shall first "
     "attempt to resolve any dispute through good-faith negotiation between senior executives "
     "for 30 days, after which either party may submit the dispute to the courts of $law."),
]
CLAUSES_ZH = [
    ("服务内容", "乙方应按照双方签署的各份工作说明书，向甲方提供软件开发、系统集成及运维服务。工作说明书应载明交付物、"
     "里程碑、验收标准及相应费用。本协议与工作说明书冲突的，以本协议为准。"),
    ("协议期限", "本协议自$start起生效，有效期$term个月。期满前$notice日内任何一方未书面提出异议的，本协议自动续期一年。"),
    ("费用与支付", "甲方应按月向乙方支付服务费。乙方于每月5日前开具上月增值税专用发票，甲方应在收到发票后$payterm日内付款。"
     "首期工作说明书预估总费用为$fee（含税）。"),
    ("逾期付款", "甲方逾期付款的，每逾期一日按应付未付金额的万分之$interest支付违约金；逾期超过45日的，乙方有权书面通知后暂停服务。"),
    ("保密条款", "双方对在合作过程中知悉的对方商业秘密和技术信息负有保密义务，未经对方书面同意不得向任何第三方披露。"
     "保密义务在本协议终止后继续有效五年。"),
    ("知识产权", "甲方付清全部费用后，乙方为甲方专门开发的交付物的知识产权归甲方所有。乙方原有的工具、代码库和技术诀窍仍归乙方所有，"
     "乙方授予甲方永久、非独占、免费的使用许可。"),
    ("质量保证", "乙方保证交付物在验收后$warranty日内符合约定规格。质保期内发现缺陷的，乙方应在接到通知后5个工作日内免费修复。"),
    ("责任限制", "任何一方均不对间接损失、利润损失或数据丢失承担责任。任何一方在本协议项下的累计赔偿责任不超过索赔前十二个月"
     "甲方已支付费用的$cap倍，但违反保密义务或存在故意、重大过失的除外。"),
    ("协议解除", "一方严重违约且在收到书面通知后$cure日内未予纠正的，守约方有权书面通知解除本协议。甲方可提前$conv日书面通知"
     "无理由解除本协议，但应支付截至解除日已完成工作的费用。"),
    ("数据保护", "乙方处理甲方提供的个人信息时，应当遵守《中华人民共和国个人信息保护法》，采取必要的安全措施，"
     "发生数据泄露的应在$breach小时内通知甲方，并在服务结束后删除或返还全部个人信息。"),
    ("服务水平", "乙方保证托管系统每月可用率不低于$sla%，计划内维护须提前48小时通知。可用率每低于目标0.5%，"
     "甲方可获得当月服务费5%的服务抵扣，最高不超过25%。"),
    ("争议解决", "因本协议引起的争议，双方应友好协商解决；协商不成的，任何一方均可向$law人民法院提起诉讼。"),
]
CONTRACT_TASKS_EN = [
    "Summarize the agreement below for a busy executive in no more than eight bullet points. "
    "Focus on money, term, exit options and risk.",
    "Read the contract and list every termination right, who holds it, the notice period and "
    "what must be paid on termination. Present the answer as a table.",
    "We are $a (the customer). Identify the five clauses that carry the most risk for us and "
    "suggest a specific redline for each.",
    "Summarize the payment terms, late-payment consequences and liability cap of this "
    "agreement, then state whether the liability cap applies to data breaches.",
    "Write a one-paragraph plain-English summary of this contract for our finance team, and "
    "list the key dates they need to put in the calendar.",
    "Compare this contract against our standard position: payment within 45 days, liability "
    "cap of at least 2x annual fees, 90 days' notice for non-renewal. List every deviation.",
]
CONTRACT_TASKS_ZH = [
    "请用不超过八条要点总结以下合同，重点关注费用、期限、解除条件和风险。",
    "请列出合同中所有的解除条款：由哪一方行使、通知期限以及解除时需支付的费用，以表格形式输出。",
    "我方是甲方。请找出对我方风险最大的三个条款，并逐条给出修改建议。",
    "请总结付款条件、逾期违约责任和赔偿上限，并说明赔偿上限是否适用于数据泄露。",
    "请为财务部门写一段通俗易懂的合同摘要，并列出需要记入日历的关键日期。",
]


def _contract_kw(s: Slots) -> dict:
    a, b = s.two_companies()
    zh = s.lang == "zh"
    return dict(
        a=a, b=b, start=s.date(), term=s.pick([12, 24, 36]), notice=s.pick([30, 60, 90]),
        payterm=s.pick([30, 45, 60]), fee=s.money(80_000, 2_400_000, 1000),
        interest=s.pick([3, 5]) if zh else s.pick(["1", "1.5", "2"]),
        warranty=s.pick([30, 60, 90]), cap=s.pick([1, 2, 3]), cure=s.pick([15, 30]),
        conv=s.pick([30, 60, 90]), breach=s.pick([24, 48, 72]),
        sla=s.pick(["99.5", "99.9", "99.95"]),
        law=s.pick(["上海市浦东新区", "北京市海淀区", "深圳市南山区", "杭州市西湖区"]) if zh
        else s.pick(["the State of New York", "England and Wales", "the State of Delaware",
                     "Ontario"]),
    )


def contract_text(s: Slots, n_clauses: int) -> tuple[str, dict]:
    kw = _contract_kw(s)
    zh = s.lang == "zh"
    pool = CLAUSES_ZH if zh else CLAUSES_EN
    picked = sorted(s.rng.sample(range(len(pool)), min(n_clauses, len(pool))))
    if zh:
        parts = [f"软件开发与技术服务协议\n\n甲方：{kw['a']}\n乙方：{kw['b']}\n签订日期：{kw['start']}\n"]
        nums = "一二三四五六七八九十"
        for i, k in enumerate(picked):
            title, body = pool[k]
            n = nums[i] if i < 10 else f"十{nums[i - 10]}"
            parts.append(f"第{n}条 {title}\n{fill(body, **kw)}")
    else:
        parts = [f"MASTER SERVICES AGREEMENT\n\nThis Master Services Agreement (the "
                 f"\"Agreement\") is made on {kw['start']} between {kw['a']} (\"Customer\") "
                 f"and {kw['b']} (\"Supplier\").\n"]
        for i, k in enumerate(picked, start=1):
            title, body = pool[k]
            parts.append(f"{i}. {title}. {fill(body, **kw)}")
    return "\n\n".join(parts), kw


def gen_contract_summary(s: Slots) -> dict:
    zh = s.lang == "zh"
    n = s.pick([3, 4, 6, 8]) if zh else s.pick([4, 8, 10, 12, 15, 15])
    text, kw = contract_text(s, n)
    task = fill(s.pick(CONTRACT_TASKS_ZH if zh else CONTRACT_TASKS_EN), **kw)
    sep = "\n\n合同全文：\n\n" if zh else "\n\n---\n\n"
    return {"prompt": task + sep + text}


# ---------------------------------------------------------------------------------------
# policies

POLICIES_EN = {
    "Travel and Expense Policy": [
        "Purpose. This policy sets out how employees of $co book business travel and claim "
        "reimbursement for reasonable expenses incurred while working on company business.",
        "Booking. All flights and hotels must be booked through the company travel portal at "
        "least 14 days in advance where possible. Economy class is required for flights under "
        "six hours; premium economy may be booked for longer flights with director approval.",
        "Accommodation. The nightly hotel limit is $hotel in major cities and $hotel2 "
        "elsewhere, excluding taxes. Employees who stay with friends or family instead may "
        "claim a flat allowance of $$40 per night.",
        "Meals. Meals are reimbursed up to $meal per day while travelling. Alcohol is not "
        "reimbursable except at client entertainment events approved in advance by a vice "
        "president.",
        "Claims. Expense claims must be submitted in the expense system within $days days of "
        "the end of the trip with itemised receipts for every item above $$25. Late claims "
        "require written approval from the finance controller.",
        "Corporate cards. Corporate cards may only be used for business expenses. Personal "
        "charges must be repaid within 10 days and repeated misuse leads to card withdrawal.",
        "Mileage. Use of a personal car is reimbursed at $mileage per mile for trips where it "
        "is cheaper than rail or rental, and parking and tolls are reimbursed at cost.",
    ],
    "Remote Work Policy": [
        "Scope. This policy applies to all permanent employees of $co who have completed their "
        "probation period. Contractors are covered by their own agreements.",
        "Eligibility. Employees may work remotely up to $rdays days per week with their "
        "manager's approval. Roles that require on-site equipment or customer presence may be "
        "excluded, and the reasons must be documented.",
        "Core hours. Remote employees must be reachable between 10:00 and 15:00 local office "
        "time and attend all team meetings with their camera on unless there is a bandwidth "
        "problem.",
        "Equipment. The company provides a laptop, a monitor and a one-time home office "
        "allowance of $allow. Company equipment remains company property and must be returned "
        "within 5 working days of leaving.",
        "Security. Employees must use the company VPN, keep devices locked when unattended, "
        "and must not work from public networks without the VPN. Printing confidential "
        "documents at home is not permitted.",
        "Working abroad. Working from another country for more than $abroad days per year "
        "requires prior approval from HR and Tax because it may create tax or immigration "
        "obligations.",
        "Review. Managers review remote arrangements every six months. An arrangement may be "
        "ended with four weeks' notice if performance or collaboration suffers.",
    ],
    "Information Security Policy": [
        "Purpose. This policy protects the confidentiality, integrity and availability of "
        "information held by $co and its customers.",
        "Classification. Information is classified as Public, Internal, Confidential or "
        "Restricted. Customer personal data and payment data are always Restricted.",
        "Access control. Access is granted on a least-privilege basis and reviewed every "
        "$review days by the system owner. Shared accounts are prohibited.",
        "Passwords and MFA. Passwords must be at least $pwlen characters. Multi-factor "
        "authentication is mandatory for email, VPN, the source code repository and all "
        "production systems.",
        "Incidents. Suspected security incidents must be reported to the security team within "
        "one hour of discovery through the #security-incidents channel or the hotline.",
        "Vendors. Vendors that process Confidential or Restricted data must pass a security "
        "assessment before contract signature and annually thereafter.",
        "Data retention. Restricted data is retained for no longer than $retain years unless "
        "a legal hold applies, after which it is securely deleted.",
    ],
}
POLICIES_ZH = {
    "差旅费用报销制度": [
        "第一条 为规范$co员工差旅行为，合理控制差旅成本，特制定本制度。",
        "第二条 员工出差须提前在OA系统提交出差申请，经部门负责人审批后方可预订交通和住宿。",
        "第三条 住宿标准：一线城市每晚不超过$hotel，其他城市每晚不超过$hotel2，超标部分由个人承担。",
        "第四条 伙食补助按每人每天$meal包干发放，无需提供发票；出差期间由客户提供餐食的，当日不再发放。",
        "第五条 员工应在出差结束后$days个工作日内提交报销单，并附齐全部发票原件，逾期需经财务总监审批。",
        "第六条 乘坐飞机一律为经济舱，高铁为二等座；确因工作需要升舱的，须事先取得副总裁书面同意。",
    ],
    "员工考勤与休假管理办法": [
        "第一条 公司实行标准工时制，工作时间为周一至周五9:00至18:00，午休一小时。",
        "第二条 员工迟到或早退30分钟以内的，每月累计三次以上按事假半天处理。",
        "第三条 员工累计工作满1年不满10年的，年休假5天；满10年不满20年的，年休假10天；满20年的，年休假15天。",
        "第四条 病假须提供二级以上医院出具的诊断证明，病假期间工资按当地最低工资标准的80%以上发放。",
        "第五条 加班须事先在系统中申请并经主管审批，工作日加班可申请调休，调休须在$days日内使用完毕。",
        "第六条 员工请假三天以上的，须经部门负责人和人力资源部共同审批。",
    ],
    "信息安全管理规定": [
        "第一条 本规定适用于$co全体员工及外包人员。",
        "第二条 公司信息分为公开、内部、机密和绝密四级，客户个人信息一律按机密级管理。",
        "第三条 系统权限按最小授权原则分配，系统负责人每$review天复核一次权限清单。",
        "第四条 密码长度不少于$pwlen位，邮箱、VPN及生产系统必须启用双因素认证。",
        "第五条 发现信息安全事件的，应在1小时内报告信息安全部，不得隐瞒或自行处理。",
        "第六条 机密数据保存期限不超过$retain年，到期后须安全销毁，并保留销毁记录。",
    ],
}
POLICY_TASKS_EN = [
    "Summarize this policy for new employees in five short bullet points.",
    "An employee asks: '$q' Answer using only the policy below and quote the relevant section.",
    "Turn this policy into a FAQ with six questions and answers.",
    "Identify any gaps or ambiguities in this policy that could cause disputes, and suggest "
    "wording to fix each one.",
    "Write a two-sentence summary of the policy and then a checklist an employee can follow.",
]
POLICY_QUESTIONS_EN = [
    "Can I book premium economy for a five-hour flight?",
    "How long do I have to submit my claim?",
    "Can I work from Portugal for a month next summer?",
    "Who do I tell if I clicked a phishing link?",
    "Do I need approval to work from home three days a week?",
]
POLICY_TASKS_ZH = [
    "请用五条要点为新员工总结以下制度。",
    "员工提问：“$q” 请仅依据以下制度回答，并引用相关条款。",
    "请把以下制度改写成包含五个问答的FAQ。",
    "请指出以下制度中可能引发争议的模糊之处，并给出修改建议。",
]
POLICY_QUESTIONS_ZH = [
    "去成都出差住宿费能报多少？", "出差回来多久之内必须报销？", "工作满三年有几天年假？",
    "发现电脑中了病毒应该怎么办？", "加班以后的调休什么时候过期？",
]


def gen_policy_summary(s: Slots) -> dict:
    zh = s.lang == "zh"
    pols = POLICIES_ZH if zh else POLICIES_EN
    title = s.pick(sorted(pols))
    kw = dict(
        co=s.company(), hotel=s.money(180, 350) if not zh else s.money(500, 900, 50),
        hotel2=s.money(120, 180) if not zh else s.money(300, 450, 50),
        meal=s.money(50, 90, 5) if not zh else s.money(80, 150, 10),
        days=s.pick([10, 15, 30]), mileage=s.pick(["$0.58", "$0.62", "$0.67"]),
        rdays=s.pick([2, 3]), allow=s.money(300, 800, 50), abroad=s.pick([20, 30, 45]),
        review=s.pick([90, 180]), pwlen=s.pick([12, 14, 16]), retain=s.pick([3, 5, 7]),
        q=s.pick(POLICY_QUESTIONS_ZH if zh else POLICY_QUESTIONS_EN),
    )
    sections = [fill(x, **kw) for x in pols[title]]
    n = s.num(max(3, len(sections) - 3), len(sections))
    keep = sorted(s.rng.sample(range(len(sections)), n))
    body = "\n".join(sections[i] for i in keep) if zh else "\n\n".join(
        f"{i}. {sections[k]}" for i, k in enumerate(keep, start=1))
    header = f"{kw['co']} {title}" if not zh else f"{kw['co']}{title}"
    task = fill(s.pick(POLICY_TASKS_ZH if zh else POLICY_TASKS_EN), **kw)
    return {"prompt": f"{task}\n\n{header}\n\n{body}"}


# ---------------------------------------------------------------------------------------
# finance review

SEGMENTS_EN = ["Enterprise Software", "Professional Services", "Hardware", "Cloud Hosting",
               "Retail Stores", "E-commerce", "Wholesale", "Licensing"]
SEGMENTS_ZH = ["企业软件", "专业服务", "硬件销售", "云服务", "线下门店", "电商渠道", "批发业务"]
FIN_TASKS_EN = [
    "Review the quarterly figures below. Compute gross margin and operating margin for each "
    "quarter, check whether the totals add up, and flag anything that looks inconsistent.",
    "You are a financial analyst at $co. Write a short management commentary (about 200 "
    "words) on the results below, highlighting trends and risks.",
    "Check this draft board report for arithmetic errors. The segment revenues should sum to "
    "total revenue and the narrative should match the table. List every discrepancy.",
    "Based on the table, which segment grew fastest year over year and which one is "
    "dragging margins down? Show your calculations.",
]
FIN_TASKS_ZH = [
    "请审阅以下季度财务数据，计算各季度毛利率和营业利润率，核对合计数是否正确，并指出异常之处。",
    "你是$co的财务分析师，请根据下表写一段约300字的管理层分析，说明趋势和风险。",
    "请检查这份董事会报告草稿中的计算错误：各业务收入之和应等于总收入，文字描述应与表格一致。",
]
FIN_NOTES_EN = [
    "Revenue growth was driven mainly by the renewal of two large multi-year contracts in the "
    "second quarter and by price increases of 4% effective from April.",
    "Cost of revenue includes a one-off inventory write-down of $wd in Q3 related to "
    "discontinued product lines.",
    "Operating expenses increased because of the opening of the new office in $city and "
    "the hiring of 35 additional sales staff.",
    "Days sales outstanding rose from 48 to 61 days, mainly because of delayed payments by "
    "one public-sector customer.",
    "Management expects full-year revenue of $guide, at the upper end of the guidance range "
    "communicated to the board in January.",
    "Foreign-exchange movements reduced reported revenue by approximately 2.1% compared with "
    "constant currency.",
]
FIN_RISKS_EN = [
    "Customer concentration. The three largest customers accounted for 38% of revenue in the "
    "period. The contract with the largest customer expires in the fourth quarter of next "
    "year and renewal negotiations have not started; losing it would reduce operating income "
    "by an estimated 22%.",
    "Supply chain. Lead times for key electronic components remain between 26 and 40 weeks. "
    "We have placed non-cancellable purchase commitments of $wd to secure supply, which "
    "exposes us to inventory risk if demand weakens.",
    "Interest rates and financing. Our revolving credit facility bears interest at SOFR plus "
    "2.25%. Each 100 basis point increase in rates raises annual interest expense by roughly "
    "$$1.4 million at current drawn balances. The facility matures in June and must be "
    "refinanced; discussions with the lending banks are ongoing.",
    "Cybersecurity. A phishing incident in $city in the second quarter led to unauthorised "
    "access to one finance mailbox. No customer data was exposed, but remediation costs of "
    "$$310,000 were expensed and further investment in email security is planned.",
    "Labour costs. Wage inflation in our operations workforce was 6.8% year over year, above "
    "the 4% assumed in the budget. Staff turnover in the warehouses reached 31%, increasing "
    "recruitment and training costs.",
]
FIN_RISKS_ZH = [
    "客户集中度风险：前三大客户收入占比达38%，最大客户合同将于明年第四季度到期，续约谈判尚未启动。",
    "供应链风险：关键电子元器件交期仍为26至40周，公司已签订$wd不可撤销采购承诺，若需求下滑将面临存货风险。",
    "利率与融资风险：公司银行授信按LPR加点计息，明年6月到期需续贷，目前正与银行沟通。",
    "信息安全风险：第二季度$city分公司发生一起钓鱼邮件事件，一个财务邮箱被非法访问，未涉及客户数据，已发生整改费用31万元。",
    "人工成本风险：一线员工工资同比上涨6.8%，高于预算假设的4%，仓库员工流失率达31%。",
]
FIN_NOTES_ZH = [
    "收入增长主要得益于第二季度两份大额多年期合同续签，以及自4月起实施的4%价格上调。",
    "第三季度营业成本中包含$wd的一次性存货跌价准备，涉及已停产的产品线。",
    "营业费用增加主要由于$city新办公室启用以及新增35名销售人员。",
    "应收账款周转天数由48天上升至61天，主要因一家国有客户付款延迟。",
    "管理层预计全年收入为$guide，处于年初向董事会报告的指引区间上限。",
]


def finance_table(s: Slots, zh: bool, n_seg: int, quarters: int) -> tuple[str, list[int]]:
    segs = s.rng.sample(SEGMENTS_ZH if zh else SEGMENTS_EN, n_seg)
    qs = [f"Q{i}" for i in range(1, quarters + 1)]
    unit = "（单位：万元）" if zh else "(in $ thousands)"
    rows = []
    totals = [0] * quarters
    for seg in segs:
        base = s.num(800, 9000)
        vals = []
        for q in range(quarters):
            base = int(base * (1 + s.rng.uniform(-0.06, 0.12)))
            vals.append(base)
            totals[q] += base
        rows.append((seg, vals))
    # one deliberate error in the reported total, as real drafts have
    reported = list(totals)
    if s.rng.random() < 0.6:
        q = s.num(0, quarters - 1)
        reported[q] += s.pick([-120, 90, 250, 1000])
    cogs = [int(t * s.rng.uniform(0.42, 0.61)) for t in totals]
    opex = [int(t * s.rng.uniform(0.18, 0.30)) for t in totals]
    h_rev = "收入" if zh else "Revenue"
    head = ["业务板块" if zh else "Segment"] + qs
    lines = [f"{h_rev} {unit}", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for seg, vals in rows:
        lines.append(f"| {seg} | " + " | ".join(f"{v:,}" for v in vals) + " |")
    lab = ("合计", "营业成本", "营业费用", "营业利润") if zh else (
        "Total revenue", "Cost of revenue", "Operating expenses", "Operating income")
    lines.append(f"| {lab[0]} | " + " | ".join(f"{v:,}" for v in reported) + " |")
    lines.append(f"| {lab[1]} | " + " | ".join(f"{v:,}" for v in cogs) + " |")
    lines.append(f"| {lab[2]} | " + " | ".join(f"{v:,}" for v in opex) + " |")
    lines.append(f"| {lab[3]} | " + " | ".join(
        f"{t - c - o:,}" for t, c, o in zip(totals, cogs, opex)) + " |")
    return "\n".join(lines), totals


def gen_finance_review(s: Slots) -> dict:
    zh = s.lang == "zh"
    co = s.company()
    year = s.pick([2024, 2025])
    n_seg, quarters = s.num(2, 5), s.pick([2, 4])
    table, totals = finance_table(s, zh, n_seg, quarters)
    kw = dict(co=co, city=s.city(), wd=s.money(200_000, 900_000, 1000),
              guide=s.money(sum(totals) * 1000, sum(totals) * 1400, 1000) if not zh
              else f"{int(sum(totals) * 1.9):,}万元")
    notes = [fill(x, **kw) for x in s.rng.sample(FIN_NOTES_ZH if zh else FIN_NOTES_EN,
                                                 s.num(1, 4))]
    task = fill(s.pick(FIN_TASKS_ZH if zh else FIN_TASKS_EN), **kw)
    parts = [task, ""]
    if zh:
        parts.append(f"{co} {year}年经营情况（未经审计）")
    else:
        parts.append(f"{co} - FY{year} quarterly results (unaudited)")
    parts += ["", table, ""]
    if s.rng.random() < 0.5:  # a second table: headcount and cash
        if zh:
            parts += ["其他指标", "| 指标 | 期初 | 期末 |", "|---|---|---|",
                      f"| 员工人数 | {s.num(120, 900)} | {s.num(120, 950)} |",
                      f"| 货币资金（万元） | {s.num(2000, 30000):,} | {s.num(2000, 30000):,} |",
                      f"| 应收账款（万元） | {s.num(800, 9000):,} | {s.num(800, 9000):,} |", ""]
        else:
            parts += ["Other metrics", "| Metric | Opening | Closing |", "|---|---|---|",
                      f"| Headcount | {s.num(120, 900)} | {s.num(120, 950)} |",
                      f"| Cash ($ thousands) | {s.num(2000, 30000):,} | "
                      f"{s.num(2000, 30000):,} |",
                      f"| Receivables ($ thousands) | {s.num(800, 9000):,} | "
                      f"{s.num(800, 9000):,} |", ""]
    parts.append("管理层说明：" if zh else "Management notes:")
    parts += [f"- {n}" for n in notes]
    if s.rng.random() < 0.5:  # the long board-pack variant also carries the risk section
        risks = FIN_RISKS_ZH if zh else FIN_RISKS_EN
        parts += ["", "主要风险：" if zh else "Principal risks:"]
        parts += [fill(r, **kw) for r in s.rng.sample(risks, s.num(2, len(risks)))]
    return {"prompt": "\n".join(parts)}


# ---------------------------------------------------------------------------------------
# HR

HR_EN = [
    "How many days of paid parental leave do employees at $co get, and can it be split into "
    "two blocks? I am expecting a baby in $month.",
    "Write a job description for a Senior Data Engineer at $co in $city: hybrid, 3 days in "
    "office, reporting to the Head of Analytics. Include responsibilities, requirements and "
    "benefits.",
    "Draft 8 structured interview questions for a customer success manager role, with what a "
    "strong answer looks like for each.",
    "An employee has been late to standup 6 times this month. Write talking points for a "
    "supportive but clear conversation with them.",
    "Create a two-week onboarding plan for a new accountant joining our finance team on $date.",
    "What is the difference between a performance improvement plan and a written warning? "
    "When should a manager use each?",
    "Write a short internal announcement that $person has been promoted to Engineering "
    "Manager, effective $date.",
    "Our annual engagement survey shows that only 41% of staff feel their workload is "
    "manageable. Suggest five concrete actions HR can take this quarter.",
    "Summarize the pros and cons of moving from annual to quarterly performance reviews for "
    "a company with about $n employees.",
    "Write a polite rejection email to a candidate who reached the final interview round for "
    "a product designer position.",
    "Is an employee entitled to overtime pay if they are salaried but earn below the "
    "exemption threshold? Explain in general terms and tell me what to check with counsel.",
    "Draft a relocation package summary for an engineer moving from $city to our headquarters.",
    "Prepare an exit interview questionnaire with 10 questions.",
]
HR_ZH = [
    "员工入职满一年后年假有几天？如果今年没休完能否顺延到明年？",
    "请为$co撰写一份“高级财务分析师”的招聘启事，工作地点$city，包含岗位职责、任职要求和福利待遇。",
    "请帮我设计8个结构化面试问题，用于招聘客户成功经理，并说明优秀回答的要点。",
    "有位员工本月迟到了6次，请帮我准备一次既体现关心又明确要求的谈话提纲。",
    "请为$date入职的新会计制定一份两周的入职培训计划。",
    "试用期员工不符合录用条件，公司应如何合法解除劳动合同？需要注意哪些风险？",
    "请写一则内部通知，宣布$person自$date起晋升为研发部经理。",
    "员工满意度调查显示只有41%的员工认为工作量合理，请给出五条人力资源部本季度可以落地的改进措施。",
    "请写一封婉拒邮件给进入终面但未被录用的产品设计师候选人。",
    "公司有$n名员工，从年度绩效考核改为季度考核有哪些利弊？",
    "请起草一份离职面谈问卷，包含10个问题。",
]


def gen_hr(s: Slots) -> dict:
    zh = s.lang == "zh"
    t = s.pick(HR_ZH if zh else HR_EN)
    return {"prompt": fill(t, co=s.company(), city=s.city(), date=s.date(), person=s.person(),
                           month=s.pick(MONTHS), n=s.pick([80, 250, 600, 1500, 4000]))}


# ---------------------------------------------------------------------------------------
# product descriptions

PRODUCTS_EN = [
    ("ErgoLift Pro standing desk", ["electric height range 62-127 cm", "dual motors",
     "4 memory presets", "load capacity 120 kg", "bamboo top 160 x 80 cm", "5-year warranty"]),
    ("AquaPure 3 water filter pitcher", ["2.4 L capacity", "filters 150 L per cartridge",
     "reduces chlorine and lead", "BPA-free", "LED cartridge indicator"]),
    ("TrailMaster 40 hiking backpack", ["40 L", "weighs 1.1 kg", "rain cover included",
     "ventilated back panel", "hydration sleeve", "hip-belt pockets"]),
    ("NimbusSound wireless earbuds", ["active noise cancelling", "32 h battery with case",
     "IPX5", "Bluetooth 5.3", "wireless charging", "multipoint pairing"]),
    ("FreshKeep vacuum food container set", ["set of 5", "hand pump included",
     "keeps food fresh 3x longer", "dishwasher safe lids", "stackable"]),
    ("SecureDesk cloud backup (business plan)", ["unlimited devices", "2 TB per user",
     "end-to-end encryption", "hourly snapshots", "SOC 2 Type II", "$$6 per user per month"]),
    ("Lumina smart LED bulb", ["16 million colours", "works with voice assistants", "9 W",
     "800 lumens", "no hub required", "schedules and scenes"]),
    ("BrewCraft espresso machine", ["15-bar pump", "built-in grinder", "steam wand",
     "1.8 L tank", "brushed stainless steel"]),
]
PRODUCTS_ZH = [
    ("智护空气净化器X5", ["CADR值500m³/h", "适用面积35-60平方米", "H13级HEPA滤网", "睡眠模式噪音28分贝",
     "APP远程控制"]),
    ("轻羽超薄羽绒服", ["90%白鸭绒", "充绒量150克", "可收纳成小包", "防泼水面料", "男女同款"]),
    ("云感记忆棉枕头", ["慢回弹记忆棉", "人体工学曲线", "可拆洗外套", "抗菌防螨", "高度可调"]),
    ("智能手表S3", ["1.43英寸AMOLED屏", "续航14天", "血氧和心率监测", "5ATM防水", "NFC支付"]),
    ("有机冷压初榨橄榄油", ["西班牙进口", "酸度≤0.3%", "750毫升", "冷压工艺", "适合凉拌和低温烹饪"]),
    ("企业版协同办公软件", ["支持500人同时在线", "文档实时协作", "数据本地化部署", "等保三级认证",
     "按年订阅"]),
    ("便携式储能电源", ["容量1024Wh", "输出功率1800W", "支持太阳能充电", "1.5小时快充", "重11公斤"]),
]
PRODUCT_TASKS_EN = [
    "Write a product description for our online store (120-160 words) for the $p. "
    "Audience: $aud. Features: $f.",
    "Write three alternative headlines and a 50-word description for the $p. Key features: $f.",
    "Create an Amazon-style listing for the $p with a title, five bullet points and a short "
    "paragraph. Features: $f. Do not invent certifications we did not list.",
    "Rewrite this dull spec list into an engaging description for $aud: $p - $f.",
]
PRODUCT_TASKS_ZH = [
    "请为$p写一段电商详情页文案（150字左右），目标人群：$aud。产品卖点：$f。",
    "请为$p写三个吸引人的商品标题和一段50字的短描述。卖点：$f。",
    "请为$p撰写小红书风格的种草文案，语气亲切自然，卖点：$f，不要夸大宣传。",
]
AUD_EN = ["remote workers", "busy parents", "small business owners", "outdoor enthusiasts",
          "IT managers", "first-time home buyers"]
AUD_ZH = ["年轻上班族", "新手父母", "中小企业主", "户外运动爱好者", "注重健康的中老年人"]


def gen_product_description(s: Slots) -> dict:
    zh = s.lang == "zh"
    name, feats = s.pick(PRODUCTS_ZH if zh else PRODUCTS_EN)
    f = s.rng.sample(feats, s.num(3, len(feats)))
    sep = "、" if zh else "; "
    t = s.pick(PRODUCT_TASKS_ZH if zh else PRODUCT_TASKS_EN)
    return {"prompt": fill(t, p=name, f=sep.join(f), aud=s.pick(AUD_ZH if zh else AUD_EN))}


# ---------------------------------------------------------------------------------------
# extraction (JSON)


def doc_invoice(s: Slots) -> tuple[str, list[str]]:
    zh = s.lang == "zh"
    seller, buyer = s.two_companies()
    n_items = s.num(2, 7)
    if zh:
        items = s.rng.sample(["服务器机柜", "网络交换机", "技术服务费", "软件许可证", "UPS电源", "光纤跳线",
                              "办公桌椅", "年度运维服务"], n_items)
        lines = [f"{it}  数量{q}  单价{p:,}元  金额{q * p:,}元"
                 for it in items for q, p in [(s.num(1, 20), s.num(100, 20000))]]
        total = sum(int(x.split("金额")[1].rstrip("元").replace(",", "")) for x in lines)
        doc = (f"增值税专用发票\n发票号码：{s.num(10000000, 99999999)}\n开票日期：{s.date()}\n"
               f"购买方：{buyer}\n纳税人识别号：91{s.num(10**15, 10**16 - 1)}\n销售方：{seller}\n"
               + "\n".join(lines) + f"\n价税合计：{total:,}元\n备注：请于{s.date()}前付款。")
        keys = ["invoice_number", "invoice_date", "buyer", "seller", "total_amount"]
    else:
        items = s.rng.sample(["Server rack 42U", "Managed switch 48-port", "Consulting hours",
                              "Annual software licence", "UPS 3kVA", "Fibre patch cables",
                              "On-site installation", "Support plan (12 months)"], n_items)
        lines, total = [], 0
        for it in items:
            q, p = s.num(1, 20), s.num(40, 9000)
            total += q * p
            lines.append(f"{it:<28} qty {q:>3}   unit ${p:,}   line ${q * p:,}")
        tax = round(total * 0.08)
        doc = (f"INVOICE {s.order_no()}\nDate: {s.date()}\nFrom: {seller}, {s.num(10, 999)} "
               f"Market Street, {s.city()}\nBill to: {buyer}\nPO reference: PO-{s.num(1000, 9999)}"
               f"\n\n" + "\n".join(lines) + f"\n\nSubtotal: ${total:,}\nSales tax (8%): "
               f"${tax:,}\nTotal due: ${total + tax:,}\nPayment terms: Net {s.pick([15, 30, 45])}"
               f"\nBank: First National, account ending {s.num(1000, 9999)}")
        keys = ["invoice_number", "invoice_date", "seller", "buyer", "total_due", "line_items"]
    return doc, keys


def doc_resume(s: Slots) -> tuple[str, list[str]]:
    zh = s.lang == "zh"
    name = s.person()
    if zh:
        doc = (f"个人简历\n姓名：{name}\n电话：139{s.num(10000000, 99999999)}\n邮箱：candidate{s.num(1, 99)}"
               f"@example.com\n求职意向：数据分析师，期望城市{s.city()}\n\n工作经历\n"
               f"{s.num(2016, 2019)}.07-至今 {s.company()} 高级数据分析师：负责销售数据看板建设，"
               f"搭建用户流失预测模型，使季度流失率下降{s.num(2, 9)}个百分点。\n"
               f"{s.num(2012, 2015)}.07-{s.num(2016, 2019)}.06 {s.company()} 数据专员：负责日报周报、"
               f"SQL取数和Excel建模。\n\n教育背景\n{s.pick(['复旦大学', '浙江大学', '武汉大学', '中山大学'])} "
               f"统计学 本科\n\n技能：SQL、Python、Tableau、英语六级")
        keys = ["name", "phone", "email", "target_role", "years_of_experience", "skills"]
    else:
        doc = (f"{name}\n{s.city()} | candidate{s.num(1, 99)}@example.com | +1 555 "
               f"{s.num(100, 999)} {s.num(1000, 9999)}\n\nEXPERIENCE\nSenior Product Analyst, "
               f"{s.company()} ({s.num(2019, 2021)} - present)\n- Built the pricing experiment "
               f"framework used by 6 product teams\n- Cut monthly reporting time by "
               f"{s.num(30, 70)}% by automating dashboards in Looker\nData Analyst, "
               f"{s.company()} ({s.num(2015, 2017)} - {s.num(2018, 2019)})\n- Owned churn and "
               f"retention analysis for the subscription business\n\nEDUCATION\nB.Sc. "
               f"Economics, {s.pick(['University of Michigan', 'McGill University', 'UC Davis'])}"
               f"\n\nSKILLS\nSQL, Python (pandas), Looker, A/B testing, stakeholder management")
        keys = ["name", "email", "location", "current_title", "current_employer", "skills"]
    return doc, keys


def doc_shipping(s: Slots) -> tuple[str, list[str]]:
    zh = s.lang == "zh"
    if zh:
        doc = (f"发货通知\n尊敬的{s.company()}：\n贵司订单{s.order_no()}已于{s.date()}从{s.city()}仓库发出，"
               f"承运商为{s.pick(['顺丰速运', '京东物流', '德邦快递', '中通快运'])}，运单号"
               f"{s.num(10**11, 10**12 - 1)}，共{s.num(2, 40)}箱，总重量{s.num(20, 900)}公斤，"
               f"预计{s.date()}送达{s.city()}。如有疑问请联系{s.person()}，电话021-{s.num(10000000, 99999999)}。")
        keys = ["order_number", "ship_date", "carrier", "tracking_number", "packages", "eta"]
    else:
        doc = (f"Shipment notification\n\nHello {s.person()},\n\nYour order {s.order_no()} "
               f"left our {s.city()} warehouse on {s.date()} with "
               f"{s.pick(['UPS Freight', 'FedEx Ground', 'DHL Express', 'Maersk'])} "
               f"(tracking {s.pick(['1Z', 'FX', 'DH'])}{s.num(10**9, 10**10 - 1)}). It contains "
               f"{s.num(2, 40)} cartons, total weight {s.num(20, 900)} kg, and is expected to "
               f"arrive on {s.date()}. Signature on delivery is required.\n\nRegards,\n"
               f"{s.company()} Fulfilment")
        keys = ["order_number", "ship_date", "carrier", "tracking_number", "packages", "eta"]
    return doc, keys


def doc_meeting(s: Slots) -> tuple[str, list[str]]:
    zh = s.lang == "zh"
    p = s.people(4)
    if zh:
        doc = (f"会议纪要\n时间：{s.date()} 14:00-15:30\n参会人：{'、'.join(p)}\n议题：新版会员系统上线计划\n"
               f"1. {p[0]}汇报开发进度，目前完成{s.num(60, 90)}%，剩余支付模块预计两周完成。\n"
               f"2. {p[1]}提出压力测试尚未开始，建议上线日期推迟一周。\n"
               f"3. 决议：上线日期定为{s.date()}，{p[2]}负责压测，{p[3]}负责客服培训。\n"
               f"4. 下次会议时间另行通知。")
        keys = ["meeting_date", "attendees", "decisions", "action_items"]
    else:
        doc = (f"Meeting notes - Q{s.num(1, 4)} planning\nDate: {s.date()}\nAttendees: "
               f"{', '.join(p)}\n\n{p[0]} said the data migration is {s.num(60, 90)}% complete; "
               f"the remaining tables are blocked on access to the legacy billing database. "
               f"{p[1]} will chase IT for credentials by Friday. The team agreed to move the "
               f"go-live to {s.date()}. {p[2]} will update the customer communication plan and "
               f"{p[3]} owns the rollback runbook. Budget remains at "
               f"{s.money(40_000, 300_000, 1000)}; no change requested.")
        keys = ["meeting_date", "attendees", "decisions", "action_items"]
    return doc, keys


def doc_contract(s: Slots) -> tuple[str, list[str]]:
    text, _ = contract_text(s, s.pick([4, 6]) if s.lang == "zh" else s.pick([8, 10, 12]))
    return text, ["customer", "supplier", "effective_date", "initial_term_months",
                  "payment_terms_days", "liability_cap", "governing_law"]


EXTRACT_TASKS_EN = [
    "Extract the following fields from the document below and return only a JSON object with "
    "exactly these keys: $keys. Use null for anything that is missing.",
    "Return a JSON object with the keys $keys for this document. Dates in ISO format "
    "(YYYY-MM-DD), amounts as numbers without currency symbols. No commentary.",
    "Parse the document and output valid JSON with keys $keys.",
]
EXTRACT_TASKS_ZH = [
    "请从以下文档中提取字段，只输出一个JSON对象，键名必须为：$keys。缺失的字段填null。",
    "请将以下文档解析为JSON，包含键$keys，日期统一为YYYY-MM-DD格式，金额为数字，不要输出其他内容。",
]


def gen_extraction(s: Slots) -> dict:
    zh = s.lang == "zh"
    kind = s.pick([doc_invoice, doc_resume, doc_shipping, doc_meeting, doc_contract,
                   doc_contract, doc_invoice])
    doc, keys = kind(s)
    t = s.pick(EXTRACT_TASKS_ZH if zh else EXTRACT_TASKS_EN)
    head = fill(t, keys=", ".join(keys))
    sep = "\n\n文档：\n" if zh else "\n\nDocument:\n"
    return {"prompt": head + sep + doc, "expect_json": True, "json_keys": keys}


# ---------------------------------------------------------------------------------------
# SQL and code

SCHEMAS = [
    ("customers(id INT PRIMARY KEY, name TEXT, country TEXT, created_at DATE)\n"
     "orders(id INT PRIMARY KEY, customer_id INT REFERENCES customers(id), order_date DATE, "
     "status TEXT, total_amount NUMERIC(12,2))\n"
     "order_items(order_id INT, product_id INT, quantity INT, unit_price NUMERIC(10,2))",
     ["the top 10 customers by total order value in $year, with their country",
      "monthly revenue for $year and the month-over-month growth rate",
      "customers who placed an order in $year but not in the previous year",
      "the average number of items per order by country, only for countries with more than "
      "50 orders"],
     ["按国家统计$year年的订单总额，并按金额降序排列", "找出$year年下单但上一年没有下单的客户"]),
    ("employees(id INT, name TEXT, department_id INT, manager_id INT, hire_date DATE, "
     "salary NUMERIC)\ndepartments(id INT, name TEXT, cost_center TEXT)",
     ["each department's headcount and median salary",
      "employees who earn more than their manager",
      "the three most recent hires in every department (use a window function)"],
     ["统计每个部门的人数和平均工资", "找出工资高于其直属经理的员工"]),
    ("tickets(id BIGINT, customer_id INT, opened_at TIMESTAMP, closed_at TIMESTAMP, priority "
     "TEXT, channel TEXT, agent_id INT)\nagents(id INT, name TEXT, team TEXT)",
     ["the median time to close high-priority tickets per team in the last 90 days",
      "the share of tickets per channel for each week of $year",
      "agents whose average resolution time is more than 1.5x their team's average"],
     ["计算每个团队最近30天高优先级工单的平均处理时长（小时）", "按渠道统计$year年每周的工单数量"]),
    ("inventory(sku TEXT, warehouse TEXT, on_hand INT, reorder_point INT, updated_at "
     "TIMESTAMP)\nsales(sku TEXT, sold_at DATE, qty INT)",
     ["SKUs below their reorder point with their average daily sales over the last 28 days",
      "days of stock remaining per SKU and warehouse"],
     ["找出库存低于补货点的SKU及其最近28天日均销量"]),
]
SQL_REVIEW = [
    "SELECT * FROM orders o, customers c WHERE o.customer_id = c.id AND YEAR(o.order_date) = "
    "2025 ORDER BY o.total_amount DESC;",
    "SELECT customer_id, COUNT(*) FROM orders WHERE status != 'cancelled' OR status IS NULL "
    "GROUP BY customer_id HAVING COUNT(*) > 5",
    "SELECT e.name, d.name FROM employees e LEFT JOIN departments d ON e.department_id = d.id "
    "WHERE d.cost_center = 'CC-100'",
]


def gen_sql(s: Slots) -> dict:
    zh = s.lang == "zh"
    ddl, qs_en, qs_zh = s.pick(SCHEMAS)
    year = s.pick([2024, 2025])
    dialect = s.pick(["PostgreSQL", "MySQL 8", "SQL Server", "BigQuery"])
    if zh:
        q = fill(s.pick(qs_zh), year=year)
        return {"prompt": f"数据库为{dialect}，表结构如下：\n{ddl}\n\n请写一条SQL：{q}。并简要解释思路。"}
    if s.rng.random() < 0.25:
        sql = s.pick(SQL_REVIEW)
        return {"prompt": f"Review this {dialect} query against the schema below. Explain any "
                          f"bugs or performance problems and give a corrected version.\n\n"
                          f"Schema:\n{ddl}\n\nQuery:\n{sql}"}
    q = fill(s.pick(qs_en), year=year)
    return {"prompt": f"Given this {dialect} schema:\n{ddl}\n\nWrite a query that returns {q}."}


CODE_SNIPPETS = [
    ("python", "def apply_discount(price, percent):\n    return price - price * percent / 100\n\n"
     "def invoice_total(lines, discount=0):\n    total = 0\n    for l in lines:\n        "
     "total += l['qty'] * l['price']\n    return apply_discount(total, discount)"),
    ("python", "import csv\n\ndef load_customers(path):\n    rows = []\n    f = open(path)\n"
     "    for row in csv.DictReader(f):\n        if row['email'] != '':\n            "
     "rows.append(row)\n    return rows"),
    ("javascript", "async function fetchOrders(customerId) {\n  const res = await fetch("
     "`/api/orders?customer=${customerId}`);\n  const data = res.json();\n  return "
     "data.items.filter(o => o.status = 'open');\n}"),
    ("java", "public BigDecimal monthlyInterest(BigDecimal balance, double annualRate) {\n    "
     "return balance.multiply(new BigDecimal(annualRate / 12));\n}"),
    ("python", "def business_days_between(start, end, holidays):\n    days = 0\n    d = start\n"
     "    while d < end:\n        if d.weekday() < 5 and d not in holidays:\n            "
     "days += 1\n        d += timedelta(days=1)\n    return days"),
    ("sql", "CREATE INDEX idx_orders_date ON orders(order_date);\n\nSELECT customer_id, "
     "SUM(total_amount)\nFROM orders\nWHERE DATE_FORMAT(order_date, '%Y-%m') = '2025-03'\n"
     "GROUP BY customer_id;"),
    ("python", "def retry(fn, attempts=3):\n    for i in range(attempts):\n        try:\n"
     "            return fn()\n        except Exception:\n            time.sleep(2 ** i)\n"
     "    return None"),
]
CODE_TASKS_EN = [
    "Review this $lang code from our billing service. Point out bugs, edge cases and style "
    "issues, then give an improved version.",
    "Write pytest-style unit tests (or the equivalent for $lang) that cover the normal case "
    "and at least three edge cases for this code.",
    "Explain what this $lang code does to a new team member, line by line.",
]
CODE_WRITE_EN = [
    "Write a Python function that reads a CSV of expense claims (columns: employee_id, date, "
    "category, amount, currency) and returns the total per employee in USD given a dict of "
    "exchange rates. Include type hints and handle unknown currencies with a clear error.",
    "Write a TypeScript function that validates an IBAN and returns a typed result object "
    "with an error message when invalid.",
    "Write a Bash script that archives log files older than 14 days from /var/log/app into "
    "a dated tar.gz and deletes the originals only if the archive was written successfully.",
    "Write a Python script that calls our internal REST endpoint /api/v2/invoices with "
    "pagination (cursor-based), retries on HTTP 429 with exponential backoff and writes the "
    "results to a JSONL file.",
    "Implement a function in Go that splits a slice of order IDs into batches of at most N "
    "and processes them concurrently with at most 4 goroutines.",
    "Write a regular expression that matches purchase order numbers like PO-2025-000123 and "
    "explain each part.",
    "Write a Python function that masks credit card numbers in free-text support tickets, "
    "keeping only the last four digits, and list the edge cases you considered.",
    "Write a SQLAlchemy model and a FastAPI endpoint that lets a manager approve or reject a "
    "leave request, returning 404 for unknown requests and 409 if it was already decided.",
    "Write a pandas snippet that pivots a sales DataFrame (region, month, revenue) into a "
    "region x month table and adds a year-to-date total column.",
    "Write a C# method that calculates straight-line depreciation for an asset given cost, "
    "salvage value and useful life in months, returning the monthly schedule.",
]
CODE_TASKS_ZH = [
    "请审查以下$lang代码，指出其中的缺陷和边界情况，并给出改进后的版本。",
    "请为以下$lang代码编写单元测试，覆盖正常情况和至少三种边界情况。",
    "请逐行解释以下$lang代码的作用，面向刚入职的同事。",
]
CODE_WRITE_ZH = [
    "请用Python写一个函数，读取报销明细CSV（列：工号、日期、类别、金额），按工号汇总金额，并对金额为负数的行报错。",
    "请写一个Python脚本，调用公司内部接口/api/v2/orders分页拉取订单，遇到429错误时指数退避重试，结果写入JSONL文件。",
    "请用Java实现一个方法，根据身份证号码计算年龄和性别，并校验号码格式。",
]


def gen_code(s: Slots) -> dict:
    zh = s.lang == "zh"
    if s.rng.random() < 0.45:
        return {"prompt": s.pick(CODE_WRITE_ZH if zh else CODE_WRITE_EN)}
    lang, code = s.pick(CODE_SNIPPETS)
    t = fill(s.pick(CODE_TASKS_ZH if zh else CODE_TASKS_EN), lang=lang)
    return {"prompt": f"{t}\n\n```{lang}\n{code}\n```"}


# ---------------------------------------------------------------------------------------
# email

EMAIL_EN = [
    "Draft an email to $person at $co following up on yesterday's demo. Points: thank them, "
    "attach the pricing sheet, propose a 30-minute call next week, mention the pilot could "
    "start on $date.",
    "Write an email to our supplier $co pushing back on a $pct% price increase announced for "
    "next quarter. We have been a customer for 6 years and order about $amount per year. "
    "Firm but friendly.",
    "Write an email to the whole company announcing that the $city office will be closed on "
    "$date for electrical maintenance, and what people should do instead.",
    "Draft a payment reminder to $co: invoice $order for $amount was due on $date and is now "
    "21 days overdue. This is the second reminder.",
    "Write an email to a customer explaining that their project will be delayed by two weeks "
    "because of a supplier issue, with a revised timeline and an offer of a 10% credit.",
    "Write a short welcome email to $person, who joins the marketing team on $date. Include "
    "first-day logistics: arrive at 9:30, ask for reception on floor 4, bring ID.",
    "Summarize the following points into a concise status email for leadership: migration "
    "80% done, two blockers (vendor API limits, missing test data), new go-live $date, "
    "budget on track.",
    "Rewrite this email to sound more professional: 'hey, we still dont have the signed "
    "contract from you guys, can u send it asap, legal is chasing me every day'.",
    "Write an out-of-office message for $date to $date2, directing finance questions to "
    "$person and urgent contract matters to legal@$domain.",
]
EMAIL_ZH = [
    "请给$co的$person写一封跟进邮件：感谢昨天参加产品演示，附上报价单，建议下周安排30分钟电话沟通，试点可于$date启动。",
    "请写一封邮件给供应商$co，对其下季度涨价$pct%提出异议。我们已合作6年，年采购额约$amount，语气坚定但友好。",
    "请起草一封全员通知邮件：$city办公室将于$date因电力检修关闭一天，请大家居家办公。",
    "请写一封催款邮件给$co：发票$order金额$amount，已于$date到期，现已逾期21天，这是第二次提醒。",
    "请写一封邮件向客户说明，由于供应商原因项目将延期两周，给出新的时间表，并提供10%的费用减免。",
    "请给$date入职市场部的新同事$person写一封欢迎邮件，说明第一天9:30到4楼前台报到，请携带身份证。",
    "请把下面的要点整理成一封给管理层的项目周报邮件：迁移完成80%，两个阻塞问题（供应商接口限流、测试数据缺失），"
    "新的上线日期为$date，预算正常。",
]


def gen_email(s: Slots) -> dict:
    zh = s.lang == "zh"
    co = s.company()
    domain = co.split()[0].lower() + ".com" if not zh else "example.com"
    t = s.pick(EMAIL_ZH if zh else EMAIL_EN)
    return {"prompt": fill(t, person=s.person(), co=co, date=s.date(), date2=s.date(),
                           pct=s.pick([6, 8, 12, 15]), amount=s.money(50_000, 900_000, 1000),
                           city=s.city(), order=s.order_no(), domain=domain)}


# ---------------------------------------------------------------------------------------
# multi-turn chats

CHATS_EN = [
    [("system", "You are the internal IT helpdesk assistant of $co. Be concise."),
     ("user", "My laptop won't connect to the office Wi-Fi since this morning."),
     ("assistant", "Sorry about that. Are other devices connecting, and do you see the "
      "network '$co-Corp' in the list?"),
     ("user", "Yes, my phone works and I see the network, but it says 'authentication failed'."),
     ],
    [("user", "Can you help me prepare for a salary negotiation? I'm a senior analyst in $city."),
     ("assistant", "Of course. What is your current salary, what offer did you receive, and "
      "what matters most to you besides base pay?"),
     ("user", "Current base is $amount, the offer is 8% higher, and I care about remote days."),
     ],
    [("user", "What's the difference between accrued expenses and accounts payable?"),
     ("assistant", "Accounts payable are amounts invoiced by suppliers that you have not yet "
      "paid. Accrued expenses are costs you have incurred but not yet been invoiced for, such "
      "as wages earned but not yet paid at month end."),
     ("user", "So if a consultant worked for us in March but invoices in April, where does "
      "it go in the March balance sheet?"),
     ],
    [("system", "You help the sales team of $co write customer emails."),
     ("user", "Write a follow-up to a prospect who went quiet after our proposal."),
     ("assistant", "Here is a draft:\n\nSubject: Checking in on our proposal\n\nHi "
      "$person,\n\nI wanted to follow up on the proposal we sent on $date. Do you have any "
      "questions I can answer?\n\nBest regards"),
     ("user", "Make it shorter and add a specific next step, like a 15-minute call."),
     ],
    [("user", "I need a SQL query for monthly active users from an events table "
      "(user_id, event_time, event_name)."),
     ("assistant", "SELECT date_trunc('month', event_time) AS month, COUNT(DISTINCT user_id) "
      "AS mau FROM events GROUP BY 1 ORDER BY 1;"),
     ("user", "Only count users who did at least 3 events in that month."),
     ],
    [("user", "Our customer $co says our invoice $order is wrong. How should I respond?"),
     ("assistant", "First confirm what exactly they think is wrong: quantity, price, tax, or "
      "a missing credit. Could you share their message?"),
     ("user", "They say the unit price should be the contract price of $price, not list price."),
     ("assistant", "Then check the contract price schedule. If they are right, issue a "
      "credit note for the difference and a corrected invoice."),
     ("user", "They are right. Please draft the reply to the customer."),
     ],
]
CHATS_ZH = [
    [("system", "你是$co的内部IT服务台助手，回答简洁。"),
     ("user", "我的电脑今天早上开始连不上公司WiFi。"),
     ("assistant", "抱歉给您带来不便。请问手机等其他设备能连接吗？能看到公司网络名称吗？"),
     ("user", "手机可以连，也能看到网络，但电脑提示“身份验证失败”。")],
    [("user", "应计费用和应付账款有什么区别？"),
     ("assistant", "应付账款是供应商已开票但尚未支付的款项；应计费用是已经发生但尚未收到发票的费用，比如月底已发生未支付的工资。"),
     ("user", "那顾问3月份提供了服务、4月份才开发票，3月底的资产负债表里应该怎么记？")],
    [("user", "帮我写一段产品上新的朋友圈文案，产品是$p。"),
     ("assistant", "好的，请问目标客户是谁？希望突出哪些卖点？有没有优惠活动？"),
     ("user", "面向年轻上班族，突出便携和续航，首发期间8折。")],
    [("user", "客户$co说我们的发票$order金额不对，我该怎么回复？"),
     ("assistant", "请先确认客户认为哪里有误：数量、单价、税率还是遗漏了折扣？方便把客户原话发给我吗？"),
     ("user", "客户说单价应该按合同价$price，而不是目录价。"),
     ("assistant", "那请先核对合同价格附件。如果客户说得对，需要开具红字发票并重新开具正确的发票。"),
     ("user", "核对过了，客户是对的。请帮我起草回复邮件。")],
    [("system", "你是公司的人力资源助手。"),
     ("user", "我下个月要休产假，需要提前准备哪些材料？"),
     ("assistant", "一般需要准备：医院出具的预产期证明、生育登记服务单以及请假申请。请问您所在城市是哪里？各地生育津贴政策不同。"),
     ("user", "我在$city，社保已经连续缴纳三年。")],
]


def gen_multi_turn(s: Slots) -> dict:
    zh = s.lang == "zh"
    chat = s.pick(CHATS_ZH if zh else CHATS_EN)
    kw = dict(co=s.company(), city=s.city(), amount=s.money(70_000, 160_000, 1000),
              person=s.person(), date=s.date(), order=s.order_no(),
              price=s.money(12, 400, 1), p=s.pick([p for p, _ in PRODUCTS_ZH]))
    msgs = [{"role": r, "content": fill(c, **kw)} for r, c in chat]
    # some chats stop at the last assistant turn: calibration then also sees a full answer
    if s.rng.random() < 0.2 and msgs[-2]["role"] == "assistant":
        msgs = msgs[:-1]
    return {"messages": msgs}


GENERATORS = {
    "customer_support": gen_customer_support,
    "contract_summary": gen_contract_summary,
    "policy_summary": gen_policy_summary,
    "finance_review": gen_finance_review,
    "hr": gen_hr,
    "product_description": gen_product_description,
    "extraction": gen_extraction,
    "sql": gen_sql,
    "code": gen_code,
    "email": gen_email,
    "multi_turn": gen_multi_turn,
}


def _key(rec: dict) -> str:
    if "prompt" in rec:
        return rec["prompt"]
    return "\n".join(m["content"] for m in rec["messages"])


def generate(seed: int = SEED) -> list[dict]:
    """All records, each prompt text unique across the whole set."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    for cat, (n_en, n_zh) in COUNTS.items():
        for lang, n in (("en", n_en), ("zh", n_zh)):
            made, tries = 0, 0
            while made < n:
                tries += 1
                assert tries < 50 * n, f"cannot make {n} unique {cat}/{lang} prompts"
                body = GENERATORS[cat](Slots(random.Random(rng.getrandbits(64)), lang))
                key = _key(body)
                if key in seen:
                    continue
                seen.add(key)
                made += 1
                rec = {"id": f"{cat}-{lang}-{made:03d}", "category": cat, "lang": lang}
                rec.update(body)
                out.append(rec)
    return out


def split(records: list[dict], seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """Stratified by (category, lang): round(25%) of each stratum (at least 1) goes to eval."""
    rng = random.Random(seed + 1)
    calib, evals = [], []
    strata: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        strata.setdefault((r["category"], r["lang"]), []).append(r)
    for key in sorted(strata):
        group = list(strata[key])
        rng.shuffle(group)
        n_eval = max(1, round(len(group) * EVAL_FRACTION))
        evals += sorted(group[:n_eval], key=lambda r: r["id"])
        calib += sorted(group[n_eval:], key=lambda r: r["id"])
    return calib, evals


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)  # atomic on POSIX


def main() -> None:
    records = generate()
    calib, evals = split(records)
    write_jsonl(HERE / "business_calib.jsonl", calib)
    write_jsonl(HERE / "business_eval.jsonl", evals)
    print(f"wrote {len(calib)} calibration and {len(evals)} evaluation prompts to {HERE}")


if __name__ == "__main__":
    main()
